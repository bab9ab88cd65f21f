"""kvpager's KV events and load, in Dynamo's terms, for its KV router.

Dynamo's router hashes token ids itself (per block of `kv_cache_block_size` tokens, the block
size the worker registered): a stored event carries each block's token ids, plus an id of the
worker's choosing to name it in the removal. kvpager's chained sha256 (engine/kv/block_hash.py)
gives that id: its first 8 bytes as a signed 64-bit integer, the parent's the same way. Only
device blocks are reported; a block stored and evicted again before the events are taken is
not reported at all.
"""

from typing import Any, Protocol

from kvpager.engine.kv.block_pool import BlockPool
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored, KvEvent


class Publisher(Protocol):
    """What we use of dynamo.llm.KvEventPublisher."""

    def publish_batch(self, events: list[dict[str, Any]]) -> None: ...


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little", signed=True)


class DynamoKvEvents:
    def __init__(self, publisher: Publisher, pool: BlockPool, block_size: int) -> None:
        self.publisher = publisher
        self.pool = pool
        self.block_size = block_size
        self.published: set[bytes] = set()  # stored and not removed, as Dynamo heard it

    def publish(self, events: list[KvEvent]) -> int:
        """Translate and send one batch; returns the events sent."""
        batch = [e for e in map(self._translate, events) if e is not None]
        if batch:
            self.publisher.publish_batch(batch)
        return len(batch)

    def _translate(self, event: KvEvent) -> dict[str, Any] | None:
        if isinstance(event, BlockStored) and event.tier == "device":
            return self._stored(event)
        if isinstance(event, BlockRemoved) and event.tier == "device":
            if event.block_hash not in self.published:
                return None
            self.published.discard(event.block_hash)
            return {"type": "removed", "block_hashes": [external_hash(event.block_hash)]}
        return None

    def _stored(self, event: BlockStored) -> dict[str, Any] | None:
        token_ids = self.pool.cached_token_ids(event.block_hash)
        if token_ids is None or len(token_ids) != self.block_size:
            return None  # evicted since (its removal is skipped too)
        self.published.add(event.block_hash)
        parent = event.parent_hash
        return {
            "type": "stored",
            "token_ids": list(token_ids),
            "num_block_tokens": [self.block_size],
            "block_hashes": [external_hash(event.block_hash)],
            "parent_hash": None if parent is None else external_hash(parent),
        }
