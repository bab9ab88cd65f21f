"""The KV index of a router: block hash -> the instances whose prefix cache holds it.

Built from each instance's KV events (schemas/tokenizer.py: blocks stored, removed, cleared),
numbered per scheduler. A gap in the numbers (events lost) or a new scheduler drops what the
index knew of that instance: from then on it holds only blocks stored since, a subset of the
truth, so an overlap may be underestimated but never counts a block that may be gone.
Blocks on an instance's disk tier (events with tier "disk") are kept apart: a hit there saves
the prefill but costs a read (engine/router/routing.py weighs it). Pinned blocks (a stored
event with `pinned_until`) are noted with the end of their pin.
"""

import structlog
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored, KvEvents

log = structlog.get_logger(__name__)


class KvIndex:
    def __init__(self) -> None:
        self.holders: dict[bytes, set[str]] = {}  # block hash -> instances holding it
        self.by_instance: dict[str, set[bytes]] = {}
        self.disk_by_instance: dict[str, set[bytes]] = {}  # blocks on each instance's disk
        # instance -> pinned block hash -> unix time its pin ends
        self.pinned_by_instance: dict[str, dict[bytes, float]] = {}
        self._next_seq: dict[str, tuple[str, int]] = {}  # instance -> (scheduler id, seq)
        self.num_resyncs = 0

    def apply(self, batch: KvEvents) -> None:
        """One scheduler's numbered events; a gap or a new scheduler resyncs the instance."""
        expected = self._next_seq.get(batch.instance)
        if expected != (batch.scheduler_id, batch.seq):
            if expected is not None or batch.seq != 0:
                self.num_resyncs += 1
                log.info("kv index resync", instance=batch.instance, seq=batch.seq)
            self.clear(batch.instance)
        self._next_seq[batch.instance] = (batch.scheduler_id, batch.seq + 1)
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved) and event.tier == "disk":
                self._apply_disk(batch.instance, event)
            elif isinstance(event, BlockStored):
                self.holders.setdefault(event.block_hash, set()).add(batch.instance)
                self.by_instance.setdefault(batch.instance, set()).add(event.block_hash)
                if event.pinned_until is not None:
                    pinned = self.pinned_by_instance.setdefault(batch.instance, {})
                    pinned[event.block_hash] = event.pinned_until
            elif isinstance(event, BlockRemoved):
                self._remove(batch.instance, event.block_hash)
            else:
                self.clear(batch.instance)

    def _apply_disk(self, instance: str, event: BlockStored | BlockRemoved) -> None:
        on_disk = self.disk_by_instance.setdefault(instance, set())
        if isinstance(event, BlockStored):
            on_disk.add(event.block_hash)
        else:
            on_disk.discard(event.block_hash)

    def disk_run(self, instance: str, hashes: list[bytes], start: int) -> int:
        """How many blocks of `hashes` from `start` on are on the instance's disk tier."""
        on_disk = self.disk_by_instance.get(instance, set())
        count = 0
        while start + count < len(hashes) and hashes[start + count] in on_disk:
            count += 1
        return count

    def num_pinned(self, instance: str, hashes: list[bytes], now: float) -> int:
        """How many of `hashes` the instance holds pinned (pins not ended by `now`)."""
        pinned = self.pinned_by_instance.get(instance, {})
        return sum(pinned.get(block_hash, 0.0) > now for block_hash in hashes)

    def _remove(self, instance: str, block_hash: bytes) -> None:
        self.by_instance.get(instance, set()).discard(block_hash)
        self.pinned_by_instance.get(instance, {}).pop(block_hash, None)
        holders = self.holders.get(block_hash)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self.holders[block_hash]

    def clear(self, instance: str) -> None:
        """Forget what `instance` holds (cleared, resynced, or gone)."""
        for block_hash in self.by_instance.pop(instance, set()):
            self._remove(instance, block_hash)
        self.disk_by_instance.pop(instance, None)
        self.pinned_by_instance.pop(instance, None)

    def forget(self, instance: str) -> None:
        """The instance is gone: its blocks and its event numbering."""
        self.clear(instance)
        self._next_seq.pop(instance, None)

    def overlaps(self, hashes: list[bytes]) -> dict[str, int]:
        """Per instance, how many leading blocks of `hashes` it holds (instances with 0 left
        out)."""
        overlaps: dict[str, int] = {}
        matching: set[str] | None = None
        for depth, block_hash in enumerate(hashes):
            holders = self.holders.get(block_hash, set())
            matching = set(holders) if matching is None else matching & holders
            if not matching:
                break
            for instance in matching:
                overlaps[instance] = depth + 1
        return overlaps
