"""Recurrent state as a per-sequence page: a KV-group kind whose "blocks" are state slots.

A Mamba2 (or gated DeltaNet) layer keeps a state that does not grow with the sequence: for
Mamba2 a conv1d state [conv_dim, d_conv - 1] and an SSM state [heads, head_dim, d_state] per
layer (engine/model/mamba2.py). Every recurrent layer of a model forms one group, and a
sequence holds exactly one slot of it from its first scheduled token to its end: slot s is
row s of every recurrent layer's state tensors, which the executor owns
(engine/model/mamba2.py: RecurrentStates). Only slot ids and operations cross to it.

`RecurrentBlockManager` puts the slots beside the block tables of any block manager (one
group or a HybridBlockManager for the attention layers), with its interface:
- admission: a request that holds no slot takes one with its first blocks, or none is taken
  and it waits (allocate_slots returns None), as when blocks run out;
- finish, abort and recompute preemption free the slot (a recompute restarts from zeros);
- swap preemption carries the state: the slot's rows (every recurrent layer's tensors) are
  copied into a host row held for the sequence and the slot is freed; a swap-in takes a slot
  and copies the row back (`StateOps.to_host`, `from_host`; engine/kv/host_states.py). The
  host rows are a bounded pool sized from the swap space: with none free, or none at all,
  can_swap_out is False and the scheduler recomputes, as when the CPU pool is full;
- fork (n > 1, beams) gives the child a slot of its own, not zeroed: the executor copies the
  parent's state into it as it applies the fork (ScheduledStep.state_slots names both);
  `take_state_ops` hands over the slots to zero;
- prefix caching keeps state snapshots at block boundaries (engine/kv/state_snapshots.py): a
  hit is cut back to the deepest block with one, and the new slot is restored from it
  (`StateOps.restore`) instead of zeroed. Without snapshot slots prefix caching is off; the
  manager logs why once. A block leaving the device for the CPU tier or the disk tier takes
  its snapshot along into a host row, so a hit there resumes from the deepest snapshot on any
  tier (`from_host` into the new slot).
The pool holds `num_slots` slots, at most max_num_seqs, carved out of the KV budget
(engine/kv/state_pool.py); the scheduler runs at most that many sequences, swapped ones and
pending forks counted (engine/core.py: build_scheduler), so a fork or a swap-in finds one.
"""

from dataclasses import dataclass, field

import structlog
from kvpager.engine.kv.host_states import HostSnapshots, HostSwapRows
from kvpager.engine.kv.state_snapshots import StateSnapshots
from kvpager.engine.request import Request
from kvpager.schemas.errors import ConfigError

log = structlog.get_logger(__name__)


@dataclass
class StateOps:
    """What the executor does to the state tensors before a step, in this order."""

    reset: list[int] = field(default_factory=list)  # slots new to a sequence: zeroed
    restore: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, slot) copies
    # (seq id, offset in its step tokens, snapshot slot): the state there copied out
    snapshots: list[tuple[str, int, int]] = field(default_factory=list)
    # host rows (engine/kv/host_states.py), first of all: swap-outs and snapshots of blocks
    # leaving the device, then swap-ins and restores from host snapshots
    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device row, host row)
    from_host: list[tuple[int, int]] = field(default_factory=list)  # (host row, device slot)


class StateSlots:
    """Slot ids 0..num_slots-1, each owned by at most one sequence."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ConfigError(f"num_state_slots: must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest
        self.owner: dict[str, int] = {}  # seq id -> slot
        self.ops = StateOps()

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self, seq_id: str) -> int:
        slot = self.free_slots.pop()
        self.owner[seq_id] = slot
        self.ops.reset.append(slot)
        return slot

    def release(self, seq_id: str) -> None:
        slot = self.owner.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def take_ops(self) -> StateOps:
        ops, self.ops = self.ops, StateOps()
        return ops

    def check_invariants(self) -> None:
        held = sorted(self.owner.values())
        assert len(set(held)) == len(held), "a state slot owned twice"
        assert sorted(held + self.free_slots) == list(range(self.num_slots)), "a slot lost"


class RecurrentBlockManager:
    """A block manager for the attention layers plus the recurrent layers' state slots (see
    the module docstring). Everything not about slots is the inner manager's."""

    def __init__(
        self,
        inner,
        num_slots: int,
        num_snapshot_slots: int = 0,
        slot_bytes: int = 0,
        host_rows: tuple[int, int] = (0, 0),
    ) -> None:
        """`host_rows`: the executor's host rows for swapped states and for snapshots."""
        self.inner = inner
        self.slots = StateSlots(num_slots)
        self.num_snapshot_slots, self.slot_bytes = num_snapshot_slots, slot_bytes  # stats
        self.host_swap = HostSwapRows(host_rows[0])
        self.snapshots = None
        if inner.enable_prefix_caching and num_snapshot_slots:
            self.snapshots = StateSnapshots(
                num_slots, num_snapshot_slots, inner.block_size, inner.pool, slot_bytes
            )
            if host_rows[1] and inner.cpu.enabled:
                self.snapshots.host = HostSnapshots(host_rows[0], host_rows[1], inner.pool)
        elif inner.enable_prefix_caching:
            log.info(
                "prefix caching off",
                reason="recurrent layers: a hit needs the state at its end (no snapshot slots)",
            )
            inner.enable_prefix_caching = False
            for group in getattr(inner, "groups", [inner]):
                group.enable_prefix_caching = False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.snapshots is not None

    def state_slot(self, seq_id: str) -> int:
        return self.slots.owner[seq_id]

    def find_cached_prefix(self, request: Request, max_blocks: int | None = None):
        """The inner manager's hit, cut back to the deepest block with a state snapshot."""
        if self.snapshots is None:
            return self.inner.find_cached_prefix(request, 0)
        hits = self.inner.find_cached_prefix(request, max_blocks)
        num_blocks = self.inner.num_hit_blocks(hits)
        deepest = self.snapshots.deepest(request, num_blocks)
        return hits if deepest == num_blocks else self.inner.find_cached_prefix(request, deepest)

    def allocate_slots(self, request: Request, num_new_tokens: int, hits=None):
        """The inner manager's, plus a state slot for a request without one: both or none."""
        needs_slot = request.seq_id not in self.slots.owner
        if needs_slot and not self.slots.num_free:
            return None
        new_ids = (
            self.inner.allocate_slots(request, num_new_tokens, hits)
            if hits is not None
            else self.inner.allocate_slots(request, num_new_tokens)
        )
        if new_ids is not None and needs_slot:
            slot = self.slots.take(request.seq_id)
            num_hit_blocks = self.inner.num_hit_blocks(hits) if hits else 0
            if num_hit_blocks:  # resumes from the snapshot at the hit's end, not from zeros
                self.slots.ops.reset.remove(slot)
                source, on_host = self.snapshots.restore_source(request, num_hit_blocks)
                (self.slots.ops.from_host if on_host else self.slots.ops.restore).append(
                    (source, slot)
                )
        return new_ids

    def fork(self, parent: Request, child: Request) -> None:
        self.inner.fork(parent, child)
        if not self.slots.num_free:
            raise ConfigError("num_state_slots: fewer state slots than running sequences")
        destination = self.slots.take(child.seq_id)
        self.slots.ops.reset.remove(destination)  # the executor copies the parent's over it

    def free(self, request: Request) -> None:
        self.inner.free(request)
        self.slots.release(request.seq_id)
        self.host_swap.give_back(request.seq_id)  # one swapped out, finished or aborted

    def can_swap_out(self, request: Request) -> bool:
        """The blocks fit the CPU pool and the state a host row."""
        return self.host_swap.num_free > 0 and self.inner.can_swap_out(request)

    def swap_out(self, request: Request) -> None:
        self.inner.swap_out(request)
        host_row = self.host_swap.take(request.seq_id)
        self.slots.ops.to_host.append((self.slots.owner[request.seq_id], host_row))
        self.slots.release(request.seq_id)  # reusable now: to_host is copied first

    def swap_in(self, request: Request):
        """The inner manager's, plus a slot its host row is copied back into (zeroed if it
        holds none; kv_moves.py recomputes KV imports on recurrent models, so none does)."""
        table = self.inner.swap_in(request)
        assert self.slots.num_free, "swap-in without a free state slot"
        slot = self.slots.take(request.seq_id)
        host_row = self.host_swap.give_back(request.seq_id)
        if host_row is not None:
            self.slots.ops.reset.remove(slot)
            self.slots.ops.from_host.append((host_row, slot))
        return table

    def take_state_ops(self, scheduled: list[tuple[Request, int, int]] = ()) -> StateOps:
        """The step's slot operations; with snapshots, those of the block boundaries the
        `scheduled` (request, first computed token, token count) cross."""
        ops = self.slots.take_ops()
        if self.snapshots is not None:
            ops.to_host += self.snapshots.sweep()
            for request, start, num_tokens in scheduled:
                for offset, slot in self.snapshots.plan(request, start, num_tokens):
                    ops.snapshots.append((request.seq_id, offset, slot))
            if self.snapshots.host is not None:
                self.snapshots.host.end_step()
        self.host_swap.end_step()
        return ops

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        self.slots.check_invariants()
        self.host_swap.check_invariants()
        assert set(self.host_swap.owner) <= set(self.inner.swapped_tables), "a lost host row"
        if self.snapshots is not None:
            self.snapshots.check_invariants()
        tables = self.inner.block_tables
        assert set(self.slots.owner) <= set(tables), "a state slot without blocks"
