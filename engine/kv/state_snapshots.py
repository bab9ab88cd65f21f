"""Prefix caching for recurrent layers: snapshots of a sequence's state at block boundaries.

A recurrent layer's state after p tokens summarises all of them, so a prefix hit of k blocks
is only usable with the state after k * block_size tokens. As a sequence's computed tokens
cross a block boundary (at the cache's block size, not a multiple of it), the executor copies
its state into a snapshot slot, keyed by the chained hash of the block that ends there (the
full-attention group's, engine/kv/block_hash.py). A hit is cut back to the deepest matched
block that has a snapshot; the sequence's new slot starts as a copy of it instead of zeros.

Snapshots live in state rows past the sequences' (`first_slot` on): the executor sizes them
(engine/worker/state_cache.py) and only slot ids cross (ScheduledStep.state_restores,
state_snapshots). Memory is bounded by the slot count: a snapshot whose block left the prefix
cache (evicted, reset) goes with it at the next sweep, unless the block went to the CPU tier
or on to disk: then the snapshot is copied into a host row keyed by the same hash
(engine/kv/host_states.py: HostSnapshots) and a hit on those tiers resumes from it. When every
slot is held the least recently used one is reused (never one written in the same step). A
step crossing more boundaries than there are slots keeps the deepest ones: a hit resumes from
the deepest.
"""

from collections import OrderedDict

from kvpager.engine.kv.block_hash import update_block_hashes
from kvpager.engine.kv.host_states import HostSnapshots, take_lru_row
from kvpager.engine.request import Request


class StateSnapshots:
    def __init__(
        self, first_slot: int, num_slots: int, block_size: int, pool, slot_bytes: int = 0
    ) -> None:
        self.first_slot, self.num_slots = first_slot, num_slots
        self.slot_bytes = slot_bytes  # one snapshot's, every recurrent layer's (stats)
        self.block_size = block_size
        self.pool = pool  # the block pool whose `cached` hashes the snapshots follow
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.num_hits = 0  # admissions that resumed from a snapshot
        self.num_hit_tokens = 0
        self.num_taken = 0
        self.taken_this_step: set[int] = set()  # written by the step being planned
        self.host: HostSnapshots | None = None  # snapshots of blocks on the lower tiers

    @property
    def num_held(self) -> int:
        return len(self.by_hash)

    def deepest(self, request: Request, num_blocks: int) -> int:
        """Blocks (at most `num_blocks`) of the deepest prefix with a snapshot (0: none)."""
        hashes = update_block_hashes(request, self.block_size)
        on_host = self.host.by_hash if self.host is not None else {}
        for length in range(min(num_blocks, len(hashes)), 0, -1):
            if hashes[length - 1] in self.by_hash or hashes[length - 1] in on_host:
                return length
        return 0

    def restore_source(self, request: Request, num_blocks: int) -> tuple[int, bool]:
        """The snapshot row a hit of `num_blocks` blocks resumes from (deepest() found it),
        and whether it is a host row; a device one first."""
        block_hash = request.block_hashes[num_blocks - 1]
        self.num_hits += 1
        self.num_hit_tokens += num_blocks * self.block_size
        if block_hash not in self.by_hash:
            return self.host.read(block_hash), True
        self.by_hash.move_to_end(block_hash)
        return self.by_hash[block_hash], False

    def plan(self, request: Request, start: int, num_tokens: int) -> list[tuple[int, int]]:
        """(offset in the step's tokens, snapshot slot), ascending, for each block boundary
        the request crosses computing tokens [start, start + num_tokens) whose block has none
        yet; the deepest first where slots run short."""
        hashes = update_block_hashes(request, self.block_size)
        first = start // self.block_size + 1
        # a token still in flight has no hash yet: its block's boundary waits
        last = min(start + num_tokens, len(hashes) * self.block_size)
        cuts = []
        for boundary in range(
            last - last % self.block_size, first * self.block_size - 1, -self.block_size
        ):
            block_hash = hashes[boundary // self.block_size - 1]
            if block_hash in self.by_hash:
                self.by_hash.move_to_end(block_hash)
                continue
            slot = self._take(block_hash)
            if slot is None:
                break
            cuts.append((boundary - start, slot))
        return cuts[::-1]

    def sweep(self) -> list[tuple[int, int]]:
        """Free the snapshots whose block is no longer in the prefix cache; those whose block
        went to a lower tier first move to host rows: (device row, host row) copies."""
        self.taken_this_step.clear()
        if self.host is not None:
            self.host.sweep()
        to_host = []
        for block_hash in [h for h in self.by_hash if h not in self.pool.cached]:
            slot = self.by_hash.pop(block_hash)
            self.free_slots.append(slot)
            host_row = self.host.keep(block_hash) if self.host is not None else None
            if host_row is not None:
                to_host.append((slot, host_row))
        return to_host

    def _take(self, block_hash: bytes) -> int | None:
        # every slot held: the least recently used, of earlier steps
        slot = take_lru_row(self.by_hash, self.free_slots, self.taken_this_step, block_hash)
        self.num_taken += slot is not None
        return slot

    def check_invariants(self) -> None:
        held = sorted(self.by_hash.values())
        everything = list(range(self.first_slot, self.first_slot + self.num_slots))
        assert sorted(held + self.free_slots) == everything, "a snapshot slot lost"
        if self.host is not None:
            self.host.check_invariants()
