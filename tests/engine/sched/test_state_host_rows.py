"""Host rows of the recurrent state in the scheduler (engine/kv/host_states.py): a swap
preemption copies the sequence's slot into a host row and frees the slot, the swap-in copies
it back into a slot of its own (not zeroed); with every host row held a preemption
recomputes; the executor's step check refuses host row ids and copies that would read what
the step overwrote. Every block, slot and host row free at the end of each test."""

import dataclasses

import pytest
import torch
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.step_check import Capacity, StepCheck
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.executor import NewRequest, ScheduledStep
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.sampling import SamplingParams

from tests.engine.sched.test_scheduler import add, make_scheduler, run_step
from tests.engine.sched.test_state_slots import drain

CAPACITY = Capacity(
    16, 8, 4, 2, 64, 100, num_state_slots=2, num_snapshot_slots=2, num_host_state_slots=2,
    num_host_snapshot_slots=2,
)  # fmt: skip


def swapping_scheduler(num_blocks: int, num_host_rows: int):
    scheduler = make_scheduler(
        num_blocks=num_blocks, num_cpu_blocks=16, swap_is_cheap=True, num_state_slots=4,
        num_host_state_slots=num_host_rows,
    )  # fmt: skip
    scheduler.config = dataclasses.replace(scheduler.config, preemption_mode="swap")
    return scheduler


def test_swap_carries_the_state_through_a_host_row():
    scheduler = swapping_scheduler(num_blocks=4, num_host_rows=2)
    manager = scheduler.block_manager
    add(scheduler, "a", 8, max_tokens=8)
    b = add(scheduler, "b", 8, max_tokens=8)
    run_step(scheduler)
    slot = manager.state_slot("b")
    step = run_step(scheduler)  # a needs a third block: b is swapped out, its state too
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert step.state_to_host == [(slot, 0)] and manager.host_swap.owner == {"b": 0}
    assert "b" not in manager.slots.owner
    while b.status is RequestStatus.SWAPPED:
        step = run_step(scheduler)
    new_slot = manager.state_slot("b")
    assert step.state_from_host == [(0, new_slot)] and new_slot not in step.state_resets
    assert not manager.host_swap.owner and scheduler.stats.num_swap_preemptions == 1
    drain(scheduler)
    manager.host_swap.end_step()
    assert manager.host_swap.num_free == 2


def test_with_every_host_row_held_preemption_recomputes():
    scheduler = swapping_scheduler(num_blocks=6, num_host_rows=1)
    requests = [add(scheduler, name, 8, max_tokens=8) for name in "abc"]
    while scheduler.stats.num_preemptions < 2:
        run_step(scheduler)
    assert scheduler.stats.num_swap_preemptions == 1  # the second found no host row
    statuses = {r.status for r in requests}
    assert RequestStatus.SWAPPED in statuses and RequestStatus.PREEMPTED in statuses
    drain(scheduler)


def test_a_swapped_request_aborted_gives_its_host_row_back():
    scheduler = swapping_scheduler(num_blocks=4, num_host_rows=1)
    add(scheduler, "a", 8, max_tokens=8)
    b = add(scheduler, "b", 8, max_tokens=8)
    run_step(scheduler)
    run_step(scheduler)
    assert b.status is RequestStatus.SWAPPED
    assert scheduler.abort("b")
    assert not scheduler.block_manager.host_swap.owner
    drain(scheduler)


def check(step: ScheduledStep) -> None:
    StepCheck(CAPACITY).check(step, InputBatch(2, 64, 4, torch.device("cpu")))


def test_good_host_copies_are_accepted():
    """A swap-out and a snapshot leaving the device go to the host; a new request's slot is
    filled from a host row the step does not write."""
    new = NewRequest("a", [5, 6, 7, 8], 4, SamplingParams(max_tokens=2), [1], 0)
    check(ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"a": 4},
                        state_slots={"a": 0}, state_to_host=[(1, 0), (3, 2)],
                        state_from_host=[(1, 0)]))  # fmt: skip


A = dict(num_scheduled_tokens={"a": 4}, state_slots={"a": 0})


@pytest.mark.parametrize(
    "step",
    [
        ScheduledStep(1, **A, state_to_host=[(4, 0)]),  # past the device rows
        ScheduledStep(1, **A, state_to_host=[(1, 4)]),  # past the host rows
        ScheduledStep(1, **A, state_to_host=[(1, 0), (2, 0)]),  # a host row written twice
        ScheduledStep(1, **A, state_from_host=[(4, 0)]),  # past the host rows
        ScheduledStep(1, **A, state_from_host=[(0, 1)]),  # into no sequence's slot
        ScheduledStep(1, **A, state_from_host=[(0, 0)], state_resets=[0]),  # and zeroed
        ScheduledStep(1, **A, state_from_host=[(0, 0), (1, 0)]),  # one slot filled twice
        ScheduledStep(1, **A, state_to_host=[(1, 0)], state_from_host=[(0, 0)]),  # overwritten
        ScheduledStep(1, **A, state_from_host=[(2, 0)], state_restores=[(2, 0)]),  # restored too
    ],
)  # fmt: skip
def test_bad_host_copies_are_refused(step):
    with pytest.raises(InvalidStepError, match="state"):
        check(step)


def test_a_kv_import_recomputes_on_a_recurrent_model():
    """Handed-on blocks carry no recurrent state: the continuation recomputes its prompt."""
    scheduler = make_scheduler(num_blocks=8, num_state_slots=2)
    request = Request(
        "a", list(range(10, 19)), SamplingParams(max_tokens=2), eos_token_ids=(2,),
        kv_import=KvHandoff("t", "peer", "agent", [[0, 1]], 8),
    )  # fmt: skip
    scheduler.add_request(request)
    step = run_step(scheduler)
    assert not step.kv_pulls and step.num_scheduled_tokens == {"a": 9}
    drain(scheduler)


def submit(scheduler, request_id: str, first_token: int) -> Request:
    tokens = list(range(first_token, first_token + 13))  # 3 full blocks of 4, and one token
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), eos_token_ids=(2,))
    scheduler.add_request(request)
    return request


def test_snapshots_follow_their_blocks_to_the_cpu_tier_and_back():
    scheduler = make_scheduler(
        num_blocks=6, max_num_seqs=2, enable_prefix_caching=True, num_state_slots=2,
        num_snapshot_slots=6, state_slot_bytes=100, num_cpu_blocks=16,
        num_host_snapshot_slots=4,
    )  # fmt: skip
    manager = scheduler.block_manager
    to_host = []
    for request_id, first_token in [("a", 100), ("b", 200), ("c", 300)]:
        submit(scheduler, request_id, first_token)
        while scheduler.has_unfinished:
            to_host += run_step(scheduler).state_to_host
    hashes = prompt_block_hashes(list(range(100, 113)), 4)
    assert all(h in manager.cpu.cached and h not in manager.cached for h in hashes)
    assert len(to_host) >= 3 and all(h in manager.snapshots.host.by_hash for h in hashes)
    again = submit(scheduler, "a2", 100)
    step = run_step(scheduler)
    slot, row = step.state_slots["a2"], manager.snapshots.host.by_hash[hashes[-1]]
    assert step.state_from_host == [(row, slot)] and slot not in step.state_resets
    assert again.num_cached_tokens == 12 and step.num_scheduled_tokens == {"a2": 1}
    assert manager.snapshots.host.num_hits == 1
    drain(scheduler)


def test_host_snapshots_are_bounded_and_go_with_their_blocks():
    """Two host rows for many evicted blocks: the least recently used go first, and a block
    the small CPU pool drops (no disk tier) takes its host snapshot with it."""
    scheduler = make_scheduler(
        num_blocks=6, max_num_seqs=2, enable_prefix_caching=True, num_state_slots=2,
        num_snapshot_slots=6, state_slot_bytes=100, num_cpu_blocks=4,
        num_host_snapshot_slots=2,
    )  # fmt: skip
    host = scheduler.block_manager.snapshots.host
    cpu = scheduler.block_manager.cpu
    for idx in range(6):
        submit(scheduler, f"r{idx}", 100 * (idx + 1))
        while scheduler.has_unfinished:
            run_step(scheduler)
            assert host.num_held <= 2
            assert all(h in cpu.cached or h in scheduler.block_manager.cached for h in host.by_hash)
    assert host.num_held == 2
    drain(scheduler)
