"""The step check with KV groups: one table per group, all of one length, and a null block
(-1) only in a sliding group, only before the window of the next token to compute."""

import pytest
import torch
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.step_check import Capacity, StepCheck
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.executor import CachedRequest, NewRequest, ScheduledStep
from kvpager.schemas.sampling import SamplingParams

CAPACITY = Capacity(32, 0, 4, 4, 64, 100, group_windows=(0, 4))  # full + window 4, blocks of 4
PROMPT = list(range(10, 30))  # 20 tokens: 5 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _new(full: list[int], groups: list[list[int]], computed: int = 16) -> ScheduledStep:
    new = NewRequest("a", PROMPT, len(PROMPT), GREEDY, full, computed, group_block_ids=groups)
    return ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"a": 20 - computed})


def _check(step: ScheduledStep, batch: InputBatch | None = None) -> None:
    batch = batch or InputBatch(4, 64, 4, torch.device("cpu"), num_groups=2)
    StepCheck(CAPACITY).check(step, batch)


def test_a_prefix_hit_with_nulls_before_the_window_is_accepted():
    # 16 computed: the next token (16) attends 13..16, so blocks 0-2 may be null
    _check(_new([0, 1, 2, 3, 4], [[-1, -1, -1, 5, 6]]))


@pytest.mark.parametrize(
    "name, step",
    [
        ("null inside the window", _new([0, 1, 2, 3, 4], [[-1, -1, -1, -1, 6]])),
        ("null in the full group", _new([-1, 1, 2, 3, 4], [[-1, -1, -1, 5, 6]])),
        ("a group's table missing", _new([0, 1, 2, 3, 4], [])),
        ("tables of unequal length", _new([0, 1, 2, 3, 4], [[5, 6]])),
        ("id past the cache", _new([0, 1, 2, 3, 4], [[-1, -1, -1, 5, 32]])),
        ("id below the null", _new([0, 1, 2, 3, 4], [[-2, -1, -1, 5, 6]])),
    ],
)
def test_bad_group_tables_are_refused(name, step):
    with pytest.raises(InvalidStepError):
        _check(step)


def test_group_deltas_must_cover_every_group_alike():
    batch = InputBatch(4, 64, 4, torch.device("cpu"), num_groups=2)
    step = _new([0, 1, 2, 3, 4], [[-1, -1, -1, 5, 6]])
    _check(step, batch)
    batch.add(step.new_requests[0])
    batch.states["a"].num_computed_tokens = 20
    good = CachedRequest("a", 20, [7], replace_from=5, group_new_block_ids=[[8]],
                         group_replace_from=[5])  # fmt: skip
    _check(ScheduledStep(2, cached_requests=[good]), batch)
    for bad in (
        CachedRequest("a", 20, [7], replace_from=5),  # group 1 does not grow
        CachedRequest(
            "a", 20, [7], replace_from=5, group_new_block_ids=[[]], group_replace_from=[5]
        ),  # fmt: skip
    ):
        with pytest.raises(InvalidStepError):
            _check(ScheduledStep(2, cached_requests=[bad]), batch)
    assert batch.group_tables[0, batch.states["a"].row, :5].tolist() == [0, 0, 0, 5, 6]
