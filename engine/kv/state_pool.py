"""One memory budget for the KV blocks and the recurrent states (engine/kv/state_slots.py).

A hybrid recurrent model's per-sequence states are pages of their own tensors, but they come
out of the same bytes as the KV cache, as vLLM's hybrid allocator does: the device budget
(kv_cache_memory, --kv-cache-gib, or the memory fraction left after the weights) is split,
states first, so blocks + state slots + snapshot slots fit it together:
- state slots: min(max_num_seqs, what STATE_SHARE of the budget holds), at least one; a
  request that finds no free slot waits for one (the scheduler runs at most that many);
- snapshot slots for prefix caching (engine/kv/state_snapshots.py): what SNAPSHOT_SHARE of the
  budget holds, at most one per block;
- the KV blocks: the rest.
The CPU pool splits its swap bytes the same way (`split_host_pool`): host rows for swapped
states and for lower tiers' snapshots, each at most HOST_STATE_SHARE of it, then CPU blocks.

With a fixed block count (--num-blocks) there is no byte budget: the slots (max_num_seqs of
them) and snapshots sit beside the blocks (`split_beside_blocks`).
`kvpager kv-size` prints the same split for a budget (engine/kv/recurrent_size.py).
"""

from dataclasses import dataclass

from kvpager.schemas.errors import ConfigError

STATE_SHARE = 0.5  # of the budget, at most, for the sequences' state slots
SNAPSHOT_SHARE = 0.25  # of the budget, at most, for prefix snapshots
HOST_STATE_SHARE = 0.25  # of the CPU pool's bytes, at most, for each use of host rows


@dataclass(frozen=True)
class PoolSplit:
    """How one budget of bytes is split between KV blocks and state rows."""

    budget_bytes: int  # 0: no byte budget (a fixed block count)
    block_bytes: int
    slot_bytes: int  # one state row: every recurrent layer's conv and SSM state
    num_blocks: int
    num_slots: int  # sequences' state slots (host pool: swapped sequences' rows)
    num_snapshots: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.snapshot_bytes

    def fields(self, prefix: str = "") -> dict[str, int]:
        """For the startup log and the stats."""
        names = ("num_blocks", "num_slots", "num_snapshots", "kv_bytes", "state_bytes")
        values = {name: getattr(self, name) for name in names}
        values |= {"snapshot_bytes": self.snapshot_bytes, "budget_bytes": self.budget_bytes}
        return {prefix + name: value for name, value in values.items()}

    def lines(self) -> list[str]:
        """The split for `kvpager kv-size`."""
        gib, budget = 1024**3, self.budget_bytes
        rows = [
            ("KV blocks", self.num_blocks, self.block_bytes),
            ("state slots", self.num_slots, self.slot_bytes),
            ("snapshot slots", self.num_snapshots, self.slot_bytes),
        ]
        return [
            f"  {name + ':':<16}{count:>9,} x {each:,} B = {count * each / gib:.3f} GiB"
            for name, count, each in rows
        ] + [f"  {'total:':<16}{self.total_bytes / gib:>28.3f} GiB of {budget / gib:.3f}"]


def split_pool(
    budget_bytes: int,
    block_bytes: int,
    slot_bytes: int,
    max_num_seqs: int,
    max_blocks: int | None = None,
) -> PoolSplit:
    """Split `budget_bytes` (the module docstring); `max_blocks` caps the blocks (the CPU
    default: never more than every sequence at full length needs). `slot_bytes` 0: no states."""
    if not slot_bytes:
        return _with_blocks(budget_bytes, block_bytes, 0, 0, 0, max_blocks)
    num_slots = max(1, min(max_num_seqs, int(STATE_SHARE * budget_bytes) // slot_bytes))
    num_snapshots = int(SNAPSHOT_SHARE * budget_bytes) // slot_bytes
    split = _with_blocks(
        budget_bytes, block_bytes, slot_bytes, num_slots, num_snapshots, max_blocks
    )
    if split.num_snapshots > split.num_blocks:  # no more than one per block: the rest to KV
        split = _with_blocks(
            budget_bytes, block_bytes, slot_bytes, num_slots, split.num_blocks, max_blocks
        )
    return split


def _with_blocks(
    budget: int, block_bytes: int, slot_bytes: int, slots: int, snapshots: int, max_blocks
) -> PoolSplit:
    left = budget - (slots + snapshots) * slot_bytes
    if left < block_bytes:
        raise ConfigError(
            f"kv_cache_memory: {max(budget, 0)} bytes hold no {block_bytes}-byte KV block beside "
            f"{slots} state slot(s) of {slot_bytes} bytes; raise it, or give --num-blocks"
        )
    num_blocks = left // block_bytes if max_blocks is None else min(left // block_bytes, max_blocks)
    return PoolSplit(budget, block_bytes, slot_bytes, num_blocks, slots, snapshots)


def split_beside_blocks(
    num_blocks: int, block_bytes: int, slot_bytes: int, max_num_seqs: int
) -> PoolSplit:
    """A fixed block count: a slot per sequence and snapshots beside the blocks, as many as
    SNAPSHOT_SHARE of the blocks' bytes hold (at least one per slot, at most one per block)."""
    if not slot_bytes:
        return PoolSplit(0, block_bytes, 0, num_blocks, 0, 0)
    by_bytes = max(int(SNAPSHOT_SHARE * num_blocks * block_bytes) // slot_bytes, max_num_seqs)
    num_snapshots = min(num_blocks, by_bytes)
    return PoolSplit(0, block_bytes, slot_bytes, num_blocks, max_num_seqs, num_snapshots)


def split_host_pool(
    swap_bytes: int, block_bytes: int, slot_bytes: int, num_slots: int, disk: bool
) -> PoolSplit:
    """The CPU pool: host rows for swapped states (at most one per device slot) and for
    snapshots of blocks on lower tiers (at most one per CPU block, unless a disk tier holds
    more), each at most HOST_STATE_SHARE of `swap_bytes`; CPU blocks take the rest."""
    by_bytes = int(HOST_STATE_SHARE * swap_bytes) // slot_bytes if slot_bytes else 0
    slots = min(by_bytes, num_slots)
    num_blocks = (swap_bytes - (slots + by_bytes) * slot_bytes) // block_bytes
    snapshots = by_bytes if disk else min(by_bytes, num_blocks)
    num_blocks = (swap_bytes - (slots + snapshots) * slot_bytes) // block_bytes
    return PoolSplit(swap_bytes, block_bytes, slot_bytes, max(num_blocks, 0), slots, snapshots)
