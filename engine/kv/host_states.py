"""Recurrent state in host memory: rows of a host twin of the state tensors, counted here.

The executor keeps, beside its device state rows (engine/worker/state_cache.py), a bounded
host tensor of the same per-row shape, sized from the swap space. Its rows serve two uses:
- rows 0..num_swap_rows-1 hold the state of swapped-out sequences (`HostSwapRows`): a swap
  preemption copies the sequence's slot there and frees the slot; a swap-in takes a slot and
  copies the row back. When none is free, a swap preemption recomputes, as when the CPU pool
  is full.
- the rows past them hold prefix snapshots whose block left the device prefix cache for the
  CPU tier or the disk tier (`HostSnapshots`, keyed by the block hash): a hit on those tiers
  resumes from the deepest snapshot on any tier.

Only row ids cross to the executor: `to_host` (device row, host row) pairs are copied before
`from_host` (host row, device row) pairs, both before the step's resets, restores and forks.
A row released in a step (read by a swap-in) is reusable only at the next step, so this
step's `to_host` copies never overwrite what its `from_host` copies read.
"""

from collections import OrderedDict


def take_lru_row(
    by_hash: OrderedDict[bytes, int], free_rows: list[int], busy: set[int], block_hash: bytes
) -> int | None:
    """A row for `block_hash`'s snapshot: a free one, else the least recently used one not
    `busy` (used by the step being planned); None when every row is busy. Marks it busy."""
    if not free_rows:
        oldest = next((h for h, row in by_hash.items() if row not in busy), None)
        if oldest is None:
            return None
        free_rows.append(by_hash.pop(oldest))
    row = free_rows.pop()
    by_hash[block_hash] = row
    busy.add(row)
    return row


class HostSwapRows:
    """Host rows for swapped-out sequences' states, one per sequence."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.free_rows = list(range(num_rows - 1, -1, -1))  # pop() takes the lowest
        self.released: list[int] = []  # reusable from the next step
        self.owner: dict[str, int] = {}  # seq id -> host row
        self.num_swapped_out = self.num_swapped_in = 0

    @property
    def num_free(self) -> int:
        return len(self.free_rows)

    def take(self, seq_id: str) -> int:
        row = self.free_rows.pop()
        self.owner[seq_id] = row
        self.num_swapped_out += 1
        return row

    def give_back(self, seq_id: str) -> int | None:
        """The sequence's row (None: it holds none); free again from the next step."""
        row = self.owner.pop(seq_id, None)
        if row is not None:
            self.released.append(row)
        return row

    def end_step(self) -> None:
        self.free_rows.extend(self.released)
        self.released = []

    def check_invariants(self) -> None:
        rows = sorted([*self.owner.values(), *self.free_rows, *self.released])
        assert rows == list(range(self.num_rows)), "a host state row lost or held twice"


class HostSnapshots:
    """Prefix snapshots of blocks on the CPU and disk tiers, in host rows past the swap rows;
    the least recently used goes first when all are held (never one used in this step)."""

    def __init__(self, first_row: int, num_rows: int, pool) -> None:
        self.first_row, self.num_rows = first_row, num_rows
        self.pool = pool  # the block pool (engine/kv/block_pool.py) and its tiers
        self.free_rows = list(range(first_row + num_rows - 1, first_row - 1, -1))
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.used_this_step: set[int] = set()  # read or written by the step being planned
        self.num_hits = 0  # admissions that resumed from a host snapshot

    @property
    def num_held(self) -> int:
        return len(self.by_hash)

    def keep(self, block_hash: bytes) -> int | None:
        """A row for the snapshot of a block leaving the device (None: not kept)."""
        if block_hash in self.by_hash or not self.in_lower_tier(block_hash):
            return None
        return take_lru_row(self.by_hash, self.free_rows, self.used_this_step, block_hash)

    def read(self, block_hash: bytes) -> int:
        """The row a hit resumes from; kept from eviction for the rest of the step."""
        self.by_hash.move_to_end(block_hash)
        row = self.by_hash[block_hash]
        self.used_this_step.add(row)
        self.num_hits += 1
        return row

    def in_lower_tier(self, block_hash: bytes) -> bool:
        """The block is in the CPU pool, on disk or being read from it."""
        disk = self.pool.disk
        return (
            block_hash in self.pool.cpu.cached
            or block_hash in disk.on_disk
            or block_hash in disk.loading
        )

    def sweep(self) -> None:
        """Free the snapshots whose block is on no tier any more (one swapped back in from
        the CPU pool is on the device again: its snapshot stays here)."""
        gone = [
            h
            for h, row in self.by_hash.items()
            if h not in self.pool.cached
            and not self.in_lower_tier(h)
            and row not in self.used_this_step
        ]
        for block_hash in gone:
            self.free_rows.append(self.by_hash.pop(block_hash))

    def end_step(self) -> None:
        self.used_this_step.clear()

    def check_invariants(self) -> None:
        held = sorted(self.by_hash.values())
        everything = list(range(self.first_row, self.first_row + self.num_rows))
        assert sorted(held + self.free_rows) == everything, "a host snapshot row lost"
