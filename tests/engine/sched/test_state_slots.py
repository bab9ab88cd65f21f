"""Recurrent state slots in the scheduler (engine/kv/state_slots.py): a request needs a slot
to be admitted, finish and abort free it, preemption recomputes (never swaps) and frees it, a
fork copies the parent's state into a slot of the child's own, prefix caching is off; every
block and slot free at the end of each test."""

import dataclasses

import pytest
from kvpager.engine.kv.state_slots import RecurrentBlockManager, StateSlots
from kvpager.engine.request import RequestStatus
from kvpager.schemas.errors import ConfigError

from tests.engine.sched.test_scheduler import add, make_scheduler, run_step


def drain(scheduler) -> None:
    while scheduler.has_unfinished:
        run_step(scheduler)
    manager = scheduler.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.slots.num_free == manager.slots.num_slots and not manager.slots.owner


def test_admission_waits_for_a_slot_and_finish_frees_it():
    scheduler = make_scheduler(num_blocks=16, num_state_slots=2)
    assert isinstance(scheduler.block_manager, RecurrentBlockManager)
    add(scheduler, "a", 3, max_tokens=2)
    add(scheduler, "b", 5, max_tokens=6)
    c = add(scheduler, "c", 3)
    step = run_step(scheduler)
    assert set(step.num_scheduled_tokens) == {"a", "b"}  # blocks to spare, no slot for c
    manager = scheduler.block_manager
    assert sorted(manager.slots.owner.values()) == [0, 1]
    assert manager.take_state_ops().reset == [0, 1]  # new sequences start from zeros
    run_step(scheduler)  # a finishes (2 tokens): its slot goes back
    step = run_step(scheduler)
    assert "c" in step.num_scheduled_tokens and c.status is RequestStatus.RUNNING
    assert manager.state_slot("c") == manager.slots.owner["c"]
    assert manager.take_state_ops().reset == [manager.state_slot("c")]
    drain(scheduler)


def test_abort_frees_the_slot():
    scheduler = make_scheduler(num_state_slots=1)
    add(scheduler, "a", 3, max_tokens=8)
    b = add(scheduler, "b", 3)
    run_step(scheduler)
    assert scheduler.abort("a")
    run_step(scheduler)
    assert b.status is RequestStatus.RUNNING
    drain(scheduler)


@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_preemption_recomputes_and_frees_the_slot(mode):
    scheduler = make_scheduler(
        num_blocks=4, num_cpu_blocks=8, swap_is_cheap=True, num_state_slots=4
    )
    scheduler.config = dataclasses.replace(scheduler.config, preemption_mode=mode)
    add(scheduler, "a", 8, max_tokens=8)
    b = add(scheduler, "b", 8, max_tokens=8)
    run_step(scheduler)
    run_step(scheduler)  # a needs a third block: b is preempted, recomputed (no swap)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in scheduler.block_manager.slots.owner
    assert scheduler.stats.num_swap_preemptions == 0
    drain(scheduler)


def test_fork_copies_the_parent_state():
    scheduler = make_scheduler(num_state_slots=4)
    add(scheduler, "p", 6, n=3, seed=5)
    step = run_step(scheduler)
    assert [f.child_id for f in step.forks] == ["p#1", "p#2"]
    manager = scheduler.block_manager
    parent, children = manager.state_slot("p"), [manager.state_slot(c) for c in ("p#1", "p#2")]
    ops = manager.take_state_ops()
    assert ops.reset == [parent]  # the children are copied over, not zeroed
    assert ops.copy == [(parent, child) for child in children]
    assert len({parent, *children}) == 3
    drain(scheduler)


def test_fork_without_a_slot_is_a_config_error():
    scheduler = make_scheduler(num_state_slots=1)
    add(scheduler, "p", 6, n=2)
    with pytest.raises(ConfigError, match="num_state_slots"):
        run_step(scheduler)


def test_prefix_caching_is_off():
    scheduler = make_scheduler(num_blocks=16, num_state_slots=2, enable_prefix_caching=True)
    add(scheduler, "a", 8, max_tokens=1)
    drain(scheduler)
    b = add(scheduler, "b", 8, max_tokens=1)
    run_step(scheduler)
    assert scheduler.block_manager.enable_prefix_caching is False
    assert b.num_cached_tokens == 0  # a's blocks were cached by nobody
    assert scheduler.stats.prefix_hit_tokens == 0
    drain(scheduler)


def test_slot_pool_rejects_zero():
    with pytest.raises(ConfigError):
        StateSlots(0)
