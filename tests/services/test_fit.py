"""services/fit.py: every internal message cut to fit a byte budget, and joined back exactly."""

import msgspec
import pytest
from kvpager.schemas.executor import NewRequest, ScheduledStep
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import PromptLogprobs, StepDone, StepOutput
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.fit import (
    join_done,
    join_rows,
    size,
    split_deltas,
    split_done,
    split_rows,
    split_step,
)
from kvpager.services.wire import pack_within

BUDGET = 4096


def _logprobs(num: int, k: int = 20, start: int = 1) -> PromptLogprobs:
    return PromptLogprobs(
        start,
        [-0.5 - i for i in range(num)],
        [i + 1 for i in range(num)],
        [[1000 + j for j in range(k)] for _ in range(num)],
        [[-0.25 * j for j in range(k)] for _ in range(num)],
    )


def test_pack_within_keeps_order_and_budget():
    items = [list(range(n)) for n in (10, 300, 5, 700, 1, 200)]
    runs = pack_within(items, 800)
    assert [item for run in runs for item in run] == items
    assert all(size(run) <= 800 for run in runs if len(run) > 1)


def test_a_step_of_many_stop_strings_goes_in_several_messages():
    params = SamplingParams(stop=[f"stop string number {i}" for i in range(16)])
    new = [NewRequest(f"r{i}", [1, 2, 3], 3, params, [i], 0) for i in range(256)]
    step = ScheduledStep(7, new_requests=new, num_scheduled_tokens={f"r{i}": 3 for i in range(256)})
    assert size(step) > BUDGET * 10
    ahead, rest = split_step(step, BUDGET)
    assert len(ahead) > 10 and all(size(run) <= BUDGET for run in ahead)
    assert size(rest) <= BUDGET and rest.new_requests == []
    assert [n for run in ahead for n in run] == new  # in order, nothing lost

    small = ScheduledStep(8, new_requests=new[:2])
    assert split_step(small, BUDGET) == ([], small)


@pytest.mark.parametrize("num", [1, 2, 57, 4499])
def test_prompt_logprob_rows_split_and_join_exactly(num):
    whole = _logprobs(num)
    slices = split_rows(whole, BUDGET)
    assert all(size(s) <= BUDGET for s in slices)
    assert [s.start for s in slices] == sorted({s.start for s in slices})
    assert join_rows(slices) == whole


def test_slices_out_of_order_are_refused():
    slices = split_rows(_logprobs(200), BUDGET)
    with pytest.raises(ValueError, match="out of order"):
        join_rows([slices[0], slices[2]])


def test_a_large_step_output_travels_in_parts_and_joins_back():
    output = StepOutput(
        3,
        seq_ids=["a", "b"],
        sampled_token_ids=[5, 6],
        beam_candidates={f"beam{i}": [(t, -0.1 * t) for t in range(300)] for i in range(16)},
        prompt_logprobs={"a": _logprobs(900), "b": _logprobs(3, start=4)},
    )
    done = StepDone(output, 0.5, 0.25)
    parts, rest = split_done(done, BUDGET)
    assert len(parts) > 2 and all(size(part) <= BUDGET for part in parts)
    assert size(rest) <= BUDGET and rest.output.sampled_token_ids == [5, 6]
    assert join_done(parts, rest) == done
    small = StepDone(StepOutput(4, ["a"], [1]), 0.0, 0.0)
    assert split_done(small, BUDGET) == ([], small)


def test_token_batches_split_and_a_long_prompts_logprobs_go_over_several_deltas():
    deltas = [SampleDelta(f"r{i}", token_ids=[i] * 50) for i in range(100)]
    deltas.append(SampleDelta("p", token_ids=[9], prompt_logprobs=_logprobs(1000)))
    runs = split_deltas(deltas, BUDGET)
    assert all(size(run) <= BUDGET for run in runs)
    flat = [d for run in runs for d in run]
    assert flat[:100] == deltas[:100]
    pieces = flat[100:]
    assert len(pieces) > 2 and pieces[-1].token_ids == [9]
    assert all(d.token_ids == [] and d.finish_reason is None for d in pieces[:-1])
    assert join_rows([d.prompt_logprobs for d in pieces]) == deltas[-1].prompt_logprobs
    assert split_deltas(deltas[:2], BUDGET) == [deltas[:2]]


def test_sizes_are_msgpack_sizes():
    step = ScheduledStep(1)
    assert size(step) == len(msgspec.msgpack.encode(step))
