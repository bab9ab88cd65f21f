"""Seeded sampling from (seed, output position): a request re-sent with its outputs so far
appended to the prompt (what a migrated stream does) goes on with the very same tokens."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.frontend.migration import can_move, continuation
from kvpager.schemas.errors import InvalidRequestError

from tests.engine.helpers import assert_all_free, make_llm, random_prompts


def seeded(max_tokens: int, seed_offset: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=42,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed_offset=seed_offset,
    )


@pytest.mark.parametrize("split", [1, 5])
def test_split_run_continues_identically(tiny_llama, split):
    prompt = random_prompts([11], seed=12)[0]
    llm = make_llm(tiny_llama)
    whole = llm.generate([prompt], seeded(12))[0].outputs[0].token_ids
    # others in the batch and a fresh engine state must not matter
    head = llm.generate([prompt, prompt[:5]], seeded(split))[0].outputs[0].token_ids
    assert head == whole[:split]
    rest = llm.generate([prompt + head], seeded(12 - split, seed_offset=split))[0]
    assert head + rest.outputs[0].token_ids == whole
    assert len(set(whole)) > 3  # really sampled
    # without the offset the continuation draws position 0's randomness again
    other = llm.generate([prompt + head], seeded(12 - split))[0].outputs[0].token_ids
    assert head + other != whole
    assert_all_free(llm)


def test_seed_offset_is_validated():
    with pytest.raises(InvalidRequestError, match="seed_offset"):
        SamplingParams(seed=1, seed_offset=-1)


def test_continuation_lowers_the_limits_and_moves_the_seed():
    params = SamplingParams(seed=3, max_tokens=10, min_tokens=4, seed_offset=2)
    ids, moved = continuation([1, 2], [7, 8, 9], params)
    assert ids == [1, 2, 7, 8, 9]
    assert (moved.max_tokens, moved.min_tokens, moved.seed_offset) == (7, 1, 5)
    assert continuation([1], [5] * 10, params) is None
    assert can_move(params) and not can_move(SamplingParams(n=2))
    assert not can_move(SamplingParams(frequency_penalty=0.5))
