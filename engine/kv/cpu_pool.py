"""CpuBlockPool: the host-memory tier of the KV cache, counted in blocks.

A CPU block is free, owned by a swapped-out request, or holds an evicted prefix-cache block
(kept in LRU order and dropped first when space is needed). Blocks released during a step
become reusable only at the next step: the executor carries out a step's swap-outs before its
swap-ins, so a block read by a swap-in must not be rewritten by a swap-out of the same step.
With a disk tier, a block may also be reserved for a read from disk (`loading`), and a cached
block evicted here is handed to `on_evict` (engine/kv/disk_index.py); one cached in this very
step comes with the device block it is swapped out of, as its content reaches the pool only
with this step's swap-outs, after the disk's snapshot is taken. A cached block may be held for
a queued request (`held`, by hash, counted per request: engine/kv/disk_index.py): eviction
skips it, so a block read from disk for a request stays until that request is admitted; a
device block finding no room goes straight on to disk.
"""

from collections import OrderedDict
from collections.abc import Callable


class CpuBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.owned: set[int] = set()
        self.cached: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.released: list[int] = []
        self.loading: set[int] = set()  # being filled from disk
        self.filled: dict[int, int] = {}  # cached in this step: CPU block -> device source
        self.held: dict[bytes, int] = {}  # hash -> queued requests holding it (never evicted)
        # (hash, block id, token ids, whether the id is the device source)
        self.on_evict: Callable[[bytes, int, tuple[int, ...], bool], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.num_blocks > 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.cached) - self.num_held_cached

    @property
    def num_held_cached(self) -> int:
        """Cached blocks eviction skips: held for queued requests."""
        return sum(block_hash in self.cached for block_hash in self.held)

    def hold(self, block_hash: bytes) -> None:
        """Keep the block (cached now, or once its read lands) until `unhold`."""
        self.held[block_hash] = self.held.get(block_hash, 0) + 1

    def unhold(self, block_hash: bytes) -> None:
        count = self.held.pop(block_hash) - 1
        if count:
            self.held[block_hash] = count

    def allocate(self) -> int | None:
        """A block for a swapped-out request; evicts the oldest cached block if none is free."""
        block_id = self._take()
        if block_id is not None:
            self.owned.add(block_id)
        return block_id

    def cache(self, block_hash: bytes, token_ids: tuple[int, ...], device_block: int) -> int | None:
        """A block to keep an evicted prefix-cache block in, or None when the pool is full."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None  # already kept
        block_id = self._take()
        if block_id is not None:
            self.cached[block_hash] = (block_id, token_ids)
            self.filled[block_id] = device_block
        elif self.on_evict is not None:  # no room (held blocks): on to disk from the device
            self.on_evict(block_hash, device_block, token_ids, True)
        return block_id

    def reserve(self) -> int | None:
        """A block for a read from disk (evicting the oldest cached block if none is free)."""
        block_id = self._take()
        if block_id is not None:
            self.loading.add(block_id)
        return block_id

    def finish_load(
        self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...], ok: bool
    ) -> None:
        """A read finished: the block now holds a cached prefix block, or is free again."""
        self.loading.remove(block_id)
        if ok and block_hash not in self.cached:
            self.cached[block_hash] = (block_id, token_ids)
        else:
            self.released.append(block_id)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        entry = self.cached.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return None
        return entry[0]

    def take_cached(self, block_hash: bytes) -> int:
        """Remove a cached block that is being swapped back in; returns its block id."""
        block_id, _ = self.cached.pop(block_hash)
        self.released.append(block_id)
        return block_id

    def release(self, block_id: int) -> None:
        self.owned.remove(block_id)
        self.released.append(block_id)

    def end_step(self) -> None:
        self.free.extend(self.released)
        self.released = []
        self.filled = {}

    def _take(self) -> int | None:
        if self.free:
            return self.free.pop()
        victim = next((h for h in self.cached if h not in self.held), None)
        if victim is not None:
            block_hash, (block_id, token_ids) = victim, self.cached.pop(victim)
            if self.on_evict is not None:
                source = self.filled.get(block_id)
                on_device = source is not None
                self.on_evict(block_hash, source if on_device else block_id, token_ids, on_device)
            return block_id
        return None

    def check_invariants(self) -> None:
        cached = {block_id for block_id, _ in self.cached.values()}
        groups = [set(self.free), self.owned, cached, set(self.released), self.loading]
        assert sum(len(g) for g in groups) == self.num_blocks, "CPU blocks lost or duplicated"
        assert len(set().union(*groups)) == self.num_blocks, "a CPU block is in two states"
