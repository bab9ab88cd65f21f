"""Prefix caching for recurrent layers in the scheduler (engine/kv/state_snapshots.py): a step
names the block boundaries its sequences cross (offset, snapshot slot); a repeated prompt's
hit is cut back to the deepest block with a snapshot and its slot restored from it, not
zeroed; snapshots go with their blocks; short of rows the deepest are kept; the executor's
step check refuses snapshot ids and offsets outside what it holds."""

import pytest
import torch
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.step_check import Capacity, StepCheck
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.executor import ScheduledStep

from tests.engine.sched.test_scheduler import add, make_scheduler, run_step

CAPACITY = Capacity(16, 0, 4, 2, 64, 100, num_state_slots=2, num_snapshot_slots=3)


def snapshot_scheduler(num_snapshot_slots: int = 3):
    return make_scheduler(
        num_blocks=16, max_num_seqs=2, enable_prefix_caching=True, num_state_slots=2,
        num_snapshot_slots=num_snapshot_slots, state_slot_bytes=100,
    )  # fmt: skip


def finish(scheduler) -> None:
    while scheduler.has_unfinished:
        run_step(scheduler)
    manager = scheduler.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks and not manager.slots.owner


def check(step: ScheduledStep) -> None:
    StepCheck(CAPACITY).check(step, InputBatch(2, 64, 4, torch.device("cpu")))


def test_boundaries_are_snapshotted_and_a_repeat_resumes_from_the_deepest():
    scheduler = snapshot_scheduler()
    add(scheduler, "a", 10, max_tokens=1)
    step = scheduler.schedule()
    # rows past the 2 sequences', the deepest boundary taken first
    assert step.state_snapshots == [("a", 4, 3), ("a", 8, 2)]
    check(step)
    scheduler.update_from_output(step, _answer(step))
    finish(scheduler)
    add(scheduler, "b", 10, max_tokens=1)
    step = scheduler.schedule()
    slot = scheduler.block_manager.state_slot("b")
    assert step.num_scheduled_tokens == {"b": 2}  # 8 hit, 2 computed
    assert step.state_restores == [(2, slot)] and slot not in step.state_resets
    check(step)
    scheduler.update_from_output(step, _answer(step))
    finish(scheduler)
    snapshots = scheduler.block_manager.snapshots
    assert (snapshots.num_hits, snapshots.num_hit_tokens) == (1, 8)


def test_snapshots_go_with_their_blocks():
    scheduler = snapshot_scheduler()
    add(scheduler, "a", 10, max_tokens=1)
    finish(scheduler)
    manager = scheduler.block_manager
    assert manager.snapshots.num_held == 2
    manager.reset_prefix_cache()  # the blocks leave the prefix cache: their snapshots too
    add(scheduler, "b", 10, max_tokens=1)
    step = run_step(scheduler)
    assert not step.state_restores and step.num_scheduled_tokens == {"b": 10}
    assert manager.snapshots.num_held == 2  # b's own, in the rows a's left
    finish(scheduler)


def test_short_of_rows_the_deepest_boundary_is_kept():
    scheduler = snapshot_scheduler(num_snapshot_slots=1)
    add(scheduler, "a", 10, max_tokens=1)
    step = run_step(scheduler)
    assert step.state_snapshots == [("a", 8, 2)]
    finish(scheduler)


def test_a_hit_without_a_snapshot_is_cut_back():
    """Blocks cached but no snapshot at the hit's end: the hit stops at the deepest one."""
    scheduler = snapshot_scheduler()
    add(scheduler, "a", 10, max_tokens=1)
    finish(scheduler)
    snapshots = scheduler.block_manager.snapshots
    second = prompt_block_hashes(list(range(10, 20)), 4)[1]  # the block ending at token 8
    snapshots.free_slots.append(snapshots.by_hash.pop(second))
    add(scheduler, "b", 10, max_tokens=1)
    step = run_step(scheduler)
    assert step.state_restores == [(3, step.state_slots["b"])]
    assert step.num_scheduled_tokens == {"b": 6}  # 4 hit, 6 computed
    finish(scheduler)


@pytest.mark.parametrize(
    "step",
    [
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_restores=[(1, 0)]),  # from a sequence's row
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_restores=[(2, 1)]),  # into no sequence's slot
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_restores=[(2, 0)], state_resets=[0]),  # restored and zeroed
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_snapshots=[("a", 0, 2)]),  # offset 0
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_snapshots=[("a", 5, 2)]),  # past its tokens
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_snapshots=[("a", 4, 5)]),  # past the rows
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_snapshots=[("ghost", 1, 2)]),
        ScheduledStep(1, num_scheduled_tokens={"a": 4}, state_slots={"a": 0},
                      state_snapshots=[("a", 2, 2), ("a", 4, 2)]),  # one row twice
        ScheduledStep(1, num_scheduled_tokens={"a": 4}),  # no slot for a scheduled sequence
    ],
)  # fmt: skip
def test_bad_snapshot_ids_are_refused(step):
    with pytest.raises(InvalidStepError, match="state"):
        check(step)


def _answer(step: ScheduledStep):
    from kvpager.schemas.scheduler import StepOutput

    sampled = list(step.num_scheduled_tokens)
    return StepOutput(step.step_id, sampled, [7] * len(sampled))
