"""The executor refuses a step that does not fit it, whole, before any kernel runs, and keeps
its state: the request it was running goes on with the tokens an undisturbed run samples."""

import copy

import pytest
from kvpager.engine.worker.executor import Executor
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.executor import (
    CachedRequest,
    DiskBlock,
    ForkRequest,
    NewRequest,
    ScheduledStep,
)
from kvpager.schemas.sampling import SamplingParams

from tests.engine.helpers import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113]  # 10 tokens: two blocks of 8


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = make_llm(tiny_llama, num_blocks=16, max_num_seqs=4)
    yield engine
    engine.close()


def _prefill(step_id: int = 1) -> ScheduledStep:
    new = NewRequest("a", PROMPT, len(PROMPT), GREEDY, [3, 4], 0)
    return ScheduledStep(step_id, new_requests=[new], num_scheduled_tokens={"a": len(PROMPT)})


def _decode(step_id: int, computed: int, **changes) -> ScheduledStep:
    cached = CachedRequest("a", computed, **changes)
    return ScheduledStep(step_id, cached_requests=[cached], num_scheduled_tokens={"a": 1})


def _bad_steps(num_blocks: int) -> dict[str, ScheduledStep]:
    """Steps that must be refused right after the prefill (computed: 10 tokens in 2 blocks)."""
    huge, past = 2**31 - 1, num_blocks
    new = NewRequest("b", [7, 8], 2, GREEDY, [past], 0)
    return {
        "block id 2**31-1": _decode(2, 10, new_block_ids=[huge], replace_from=2),
        "block id just past the cache": _decode(2, 10, new_block_ids=[past], replace_from=2),
        "negative block id": _decode(2, 10, new_block_ids=[-1], replace_from=2),
        "new request past the cache": ScheduledStep(
            2, new_requests=[new], num_scheduled_tokens={"b": 2}
        ),
        "copy past the cache": ScheduledStep(2, blocks_to_copy=[(3, past)]),
        "swap into no cpu block": ScheduledStep(2, blocks_to_swap_in=[(huge, 5)]),
        "tokens past its blocks": ScheduledStep(
            2,
            new_requests=[NewRequest("c", list(range(3, 30)), 27, GREEDY, [6], 0)],
            num_scheduled_tokens={"c": 27},
        ),
        "computed count disagrees": _decode(2, 9),
        "unknown request": ScheduledStep(2, num_scheduled_tokens={"zzz": 1}),
        "more tokens than known": ScheduledStep(2, num_scheduled_tokens={"a": 5}),
        "token id outside the vocabulary": _decode(2, 10, new_token_ids=[10**6]),
        "request added twice": ScheduledStep(
            2, new_requests=[NewRequest("a", [1], 1, GREEDY, [], 0)]
        ),
        "fork of a request not sampled": ScheduledStep(2, forks=[ForkRequest("a", "a#1", 3)]),
        "replace_from past the table": _decode(2, 10, new_block_ids=[5], replace_from=7),
        "disk read into no cpu block": ScheduledStep(2, blocks_from_disk=[disk_block(huge)]),
        "disk read into the device": ScheduledStep(
            2, blocks_from_disk=[disk_block(0, on_device=True)]
        ),
        "disk write from past the cache": ScheduledStep(
            2, blocks_to_disk=[disk_block(past, on_device=True)]
        ),
        "disk block of a short hash": ScheduledStep(
            2, blocks_to_disk=[DiskBlock(b"short", 0, list(range(8)))]
        ),
        "disk block not full": ScheduledStep(2, blocks_to_disk=[DiskBlock(bytes(32), 0, [1])]),
    }


def disk_block(block_id: int, on_device: bool = False) -> DiskBlock:
    return DiskBlock(bytes(32), block_id, list(range(3, 11)), on_device)


def _snapshot(executor: Executor):
    batch = executor.batch
    states = {k: copy.deepcopy(v) for k, v in batch.states.items()}
    return states, list(batch.free_rows), batch.block_table.copy(), executor.kv_cache.clone()


def test_bad_steps_are_refused_whole_and_the_request_goes_on(llm):
    executor = llm.executor
    reference = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    executor.reset()
    first = executor.execute(_prefill())
    assert first.sampled_token_ids == reference[:1]
    for name, step in _bad_steps(executor.num_blocks).items():
        before = _snapshot(executor)
        with pytest.raises(InvalidStepError):
            executor.execute(step)
        after = _snapshot(executor)
        assert before[0] == after[0] and before[1] == after[1], name
        assert (before[2] == after[2]).all() and before[3].equal(after[3]), name
    # the undisturbed continuation: the next token is the reference's second
    second = executor.execute(_decode(2, 10, new_block_ids=[], replace_from=0))
    assert second.sampled_token_ids == reference[1:2]
    executor.execute(ScheduledStep(3, finished_seq_ids=["a"]))
    assert not executor.batch.states and len(executor.batch.free_rows) == 4


def test_a_full_table_and_too_many_rows_are_refused(llm):
    executor = llm.executor
    executor.reset()
    cap = executor.capacity
    too_long = NewRequest("x", [3] * (cap.max_model_len + 1), 1, GREEDY, [], 0)
    with pytest.raises(InvalidStepError, match="tokens"):
        executor.execute(ScheduledStep(1, new_requests=[too_long]))
    rows = [NewRequest(f"r{i}", [3], 1, GREEDY, [i], 0) for i in range(cap.max_num_seqs + 1)]
    with pytest.raises(InvalidStepError, match="max_num_seqs"):
        executor.execute(ScheduledStep(1, new_requests=rows))
    assert not executor.batch.states
