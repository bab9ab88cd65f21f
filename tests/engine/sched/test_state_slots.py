"""Recurrent state slots in the scheduler (engine/kv/state_slots.py): a request needs a slot
to be admitted, finish and abort free it, preemption without host rows recomputes (never
swaps: test_state_host_rows.py swaps with them) and frees it, a
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
    assert step.state_resets == [0, 1]  # new sequences start from zeros
    assert step.state_slots == {"a": manager.state_slot("a"), "b": manager.state_slot("b")}
    run_step(scheduler)  # a finishes (2 tokens): its slot goes back
    step = run_step(scheduler)
    assert "c" in step.num_scheduled_tokens and c.status is RequestStatus.RUNNING
    assert manager.state_slot("c") == manager.slots.owner["c"]
    assert step.state_resets == [manager.state_slot("c")]
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
    run_step(scheduler)  # a needs a third block: b is preempted, recomputed (no host row)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in scheduler.block_manager.slots.owner
    assert scheduler.stats.num_swap_preemptions == 0
    drain(scheduler)


def test_fork_gives_the_child_a_slot_to_copy_into():
    scheduler = make_scheduler(num_state_slots=4)
    add(scheduler, "p", 6, n=3, seed=5)
    step = run_step(scheduler)
    assert [f.child_id for f in step.forks] == ["p#1", "p#2"]
    manager = scheduler.block_manager
    parent, children = manager.state_slot("p"), [manager.state_slot(c) for c in ("p#1", "p#2")]
    assert step.state_resets == [parent]  # the children are copied over, not zeroed
    assert step.state_slots == {"p": parent, "p#1": children[0], "p#2": children[1]}
    assert all(fork.sample for fork in step.forks)  # copied after the prompt's forward pass
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


def test_steps_carry_state_ops_the_executor_check_accepts():
    """Only slot ids cross to the executor: each scheduled sequence's slot, new slots to
    zero, forks' copies; the executor's StepCheck accepts the scheduler's and refuses bad
    ones (a slot past its pool, two sequences in one, a fork child's slot zeroed or missing)."""
    import torch
    from kvpager.engine.worker.input_batch import InputBatch
    from kvpager.engine.worker.step_check import Capacity, StepCheck
    from kvpager.schemas.errors import InvalidStepError
    from kvpager.schemas.executor import ForkRequest, ScheduledStep

    scheduler = make_scheduler(num_state_slots=4)
    add(scheduler, "p", 6, n=2, seed=5)
    add(scheduler, "q", 3)
    step = scheduler.schedule()
    manager = scheduler.block_manager
    slots = {seq_id: manager.state_slot(seq_id) for seq_id in ("p", "p#1", "q")}
    assert step.state_slots == slots  # the fork's child too: the copy's destination
    assert step.state_resets == [slots["p"], slots["q"]]
    check = StepCheck(Capacity(8, 0, 4, 8, 64, 100, num_state_slots=4))
    check.check(step, InputBatch(8, 64, 4, torch.device("cpu")))
    bad = [
        ScheduledStep(1, num_scheduled_tokens={"a": 1}, state_slots={"a": 4}),
        ScheduledStep(1, num_scheduled_tokens={"a": 1, "b": 1}, state_slots={"a": 0, "b": 0}),
        ScheduledStep(1, state_resets=[2, 2]),
        ScheduledStep(
            1,
            num_scheduled_tokens={"a": 1},
            forks=[ForkRequest("a", "a#1", 0, True)],
            state_slots={"a": 0, "a#1": 2},
            state_resets=[2],
        ),
        ScheduledStep(
            1,
            num_scheduled_tokens={"a": 1},
            forks=[ForkRequest("a", "a#1", 0, True)],
            state_slots={"a": 0},
        ),
        ScheduledStep(1, state_slots={"ghost": 0}),
    ]
    for wrong in bad:
        with pytest.raises(InvalidStepError, match="state slot"):
            check.check(wrong, InputBatch(8, 64, 4, torch.device("cpu")))
