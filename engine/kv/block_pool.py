"""BlockPool: the device blocks' free queue, ref counts and prefix cache (vLLM v1's BlockPool).

A block is either in use (ref_count > 0, listed in one or more block tables) or free (in
`free_queue`, ref_count 0). A free block may still hold cached content (`block_hash` set): it is
reused on a prefix hit until allocation needs it, oldest-freed first (LRU); with a CPU pool, the
evicted content moves there and a later hit swaps it back in. The pool knows blocks, not
requests: the block managers (engine/kv/block_manager.py, one per KV group) keep the tables and
the policy, and several of them may share one pool.

Pinned blocks (engine/kv/pins.py: a prompt prefix kept for a time) wait in `pinned_free` when
free, and are evicted only when `free_queue` is empty, oldest-freed first. Blocks freed by a
low-priority request (priority > 0) join the free queue's head rather than its tail: they are
evicted before those of default and high-priority requests.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from kvpager.engine.kv.cpu_pool import CpuBlockPool
from kvpager.engine.kv.disk_index import DiskTier
from kvpager.engine.kv.pins import Clock, PinTable
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored, KvEvent

NULL_BLOCK = -1  # a sliding table's entry for a block slid out of the window: none held


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # content of a cached block, to verify hits


class CachedBlock(NamedTuple):
    """A prefix-cache hit: a device block, or a CPU block to swap back in."""

    block_id: int
    on_cpu: bool = False


class BlockPool:
    """The device blocks and the tiers under them (the CPU pool, the disk tier's index)."""

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, enable_disk: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.pinned_free: OrderedDict[int, None] = OrderedDict()  # free, but pinned
        self.pins = PinTable(num_blocks // 2)
        self.cached: dict[bytes, int] = {}  # block hash -> device block id
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self.disk = DiskTier(self.cpu, block_size, enable_disk)
        self.num_evictions = 0
        self.kv_events: list[KvEvent] | None = None  # recorded once someone listens

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.pinned_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def set_pin_limits(
        self, max_pinned: int, max_per_key: int = 0, clock: Clock | None = None
    ) -> None:
        """Bound the pins (engine/kv/pins.py); before any block is pinned."""
        assert not self.pins.num_pinned, "pin limits set after blocks were pinned"
        self.pins = PinTable(max_pinned, max_per_key, clock or self.pins.clock)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> CachedBlock | None:
        """The cached block holding exactly `token_ids` under `block_hash`, device first."""
        block_id = self.cached.get(block_hash)
        if block_id is not None and self.blocks[block_id].token_ids == token_ids:
            return CachedBlock(block_id)
        cpu_block = self.cpu.lookup(block_hash, token_ids)
        return None if cpu_block is None else CachedBlock(cpu_block, on_cpu=True)

    def cached_token_ids(self, block_hash: bytes) -> tuple[int, ...] | None:
        """The tokens of the device block cached under `block_hash` (None: not cached now),
        for routers that hash token ids themselves (Dynamo's)."""
        block_id = self.cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id].token_ids

    def pop_free(self) -> tuple[int, int | None]:
        """Take the oldest free block (ref_count 1). Returns it and, when it held cached
        content that the CPU pool kept, the CPU block to swap that content out to. Pinned
        blocks go last; an evicted pin's content is demoted like any other (to the CPU pool)."""
        self.expire_pins()
        if self.free_queue:
            block_id, _ = self.free_queue.popitem(last=False)
        else:
            block_id, _ = self.pinned_free.popitem(last=False)
            self.pins.num_pinned_evictions += 1
        block = self.blocks[block_id]
        cpu_block = None
        if block.block_hash is not None:
            cpu_block = self._evict(block)
        block.ref_count = 1
        return block_id, cpu_block

    def _evict(self, block: Block) -> int | None:
        """Drop a free cached block's content from the device, keeping it on CPU if it fits."""
        self.num_evictions += 1
        cpu_block = None
        if self.cpu.enabled:
            cpu_block = self.cpu.cache(block.block_hash, block.token_ids, block.block_id)
            if block.block_hash in self.cpu.cached:  # demoted: its pin waits for its return
                self.pins.demote(block.block_id, block.block_hash, self.cpu.num_blocks)
        self.uncache(block)
        return cpu_block

    def touch(self, block_id: int) -> None:
        """One more reference; a free block leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if block_id in self.pinned_free:
                del self.pinned_free[block_id]
            else:
                del self.free_queue[block_id]
        block.ref_count += 1

    def unref(self, block_id: int, low_priority: bool = False) -> None:
        """One reference fewer; an unreferenced block joins the free queue's tail (its head
        when a low-priority request frees it; the pinned queue when pinned)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count != 0:
            return
        if block_id in self.pins:
            self.pinned_free[block_id] = None
            return
        self.free_queue[block_id] = None
        if low_priority:
            self.free_queue.move_to_end(block_id, last=False)

    def pin(self, block_hash: bytes, ttl: float, key: str | None) -> bool:
        """Pin the device block cached under `block_hash` (which must be there); True if
        newly pinned (a cache write), False if its pin was only extended."""
        block_id = self.cached[block_hash]
        is_new = self.pins.pin(block_id, ttl, key)
        if block_id in self.free_queue:  # cached and free: from now on evicted last
            del self.free_queue[block_id]
            self.pinned_free[block_id] = None
        if self.kv_events is not None:
            parent = None  # the block is known already: the event only announces the pin
            until = self.pins.wall_until(block_id)
            self.kv_events.append(BlockStored(block_hash, parent, pinned_until=until))
        return is_new

    def is_pinned(self, block_hash: bytes) -> bool:
        block_id = self.cached.get(block_hash)
        return block_id is not None and block_id in self.pins

    def refresh_pin(self, block_id: int) -> None:
        self.pins.refresh(block_id)

    def expire_pins(self) -> None:
        """Blocks whose pins ended become ordinary LRU entries, at the free queue's head (their
        last use is older than the TTL)."""
        for block_id in self.pins.take_expired():
            if block_id in self.pinned_free:
                del self.pinned_free[block_id]
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def can_cache(self, block_id: int, block_hash: bytes) -> bool:
        """Neither is the block registered already nor does its content live in another."""
        return self.blocks[block_id].block_hash is None and block_hash not in self.cached

    def cache_block(
        self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...], parent: bytes | None
    ) -> None:
        """Register a full block (`can_cache`) under its chained hash; `parent`: the hash of
        the block before it, for the event."""
        assert self.can_cache(block_id, block_hash), f"block {block_id}: cached twice"
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block_id
        until = None
        if self.pins.demoted and self.pins.restore(block_id, block_hash):
            until = self.pins.wall_until(block_id)  # a demoted pin is back on the device
        if self.kv_events is not None:
            self.kv_events.append(BlockStored(block_hash, parent, pinned_until=until))

    def uncache(self, block: Block) -> None:
        """Drop a block's cached content (and so its pin); a free pinned block becomes an
        ordinary free one."""
        self.pins.unpin(block.block_id)
        if block.block_id in self.pinned_free:
            del self.pinned_free[block.block_id]
            self.free_queue[block.block_id] = None
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.append(BlockRemoved(block.block_hash))
        block.block_hash, block.token_ids = None, ()

    def record_kv_events(self) -> None:
        """From now on, record every block cached and uncached, on device and on disk."""
        self.kv_events = []
        self.disk.kv_events = []

    def take_kv_events(self) -> list[KvEvent]:
        """The events since the last call, oldest first within each tier."""
        if self.kv_events is None:
            return []
        events, self.kv_events = self.kv_events + self.disk.kv_events, []
        self.disk.kv_events = []
        return events

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                self.uncache(block)

    def check_invariants(self, refs: list[int], owned: set[int]) -> None:
        """The pool against every manager's references (`refs`: one count per block id) and
        the CPU blocks their swapped-out requests own."""
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}"
            )
            is_free = block.block_id in self.free_queue or block.block_id in self.pinned_free
            assert (block.ref_count == 0) == is_free, (
                f"block {block.block_id}: free-queue membership disagrees with ref count"
            )
        assert not self.free_queue.keys() & self.pinned_free.keys(), "a block queued twice"
        for block_id in self.pinned_free:
            assert block_id in self.pins, f"block {block_id}: in the pinned queue, unpinned"
        for block_id in self.pins.pins:
            assert self.blocks[block_id].block_hash is not None, f"block {block_id}: pinned empty"
        assert self.num_free_blocks + sum(r > 0 for r in refs) == self.num_blocks
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale cache entry {block_id}"
        assert owned == self.cpu.owned, "CPU blocks owned by no swapped request, or twice"
        self.pins.check_invariants()
        self.cpu.check_invariants()
        self.disk.check_invariants()
