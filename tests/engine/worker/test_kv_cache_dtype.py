"""A bfloat16 KV cache under a float32 model: half the bytes per block, the same greedy path
up to bf16 rounding of K/V, on the torch and C (cpu) attention backends."""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.schemas.errors import ConfigError

from tests.engine.helpers import assert_all_free, make_llm, random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_cache_follows_the_fp32_cache(tiny_llama, backend):
    prompts = random_prompts([3, 9, 17, 30], seed=11)
    budget = dict(num_blocks=None, kv_cache_memory=1 << 20, attention_backend=backend)
    full = make_llm(tiny_llama, **budget)
    half = make_llm(tiny_llama, kv_cache_dtype="bfloat16", **budget)
    assert half.executor.kv_cache.dtype == torch.bfloat16
    assert half.executor.num_blocks == 2 * full.executor.num_blocks  # same bytes, twice the blocks
    compared = 0
    for ref, got in zip(full.generate(prompts, PARAMS), half.generate(prompts, PARAMS)):
        ref, got = ref.outputs[0], got.outputs[0]
        for ref_token, got_token, ref_lp, got_lp in zip(
            ref.token_ids, got.token_ids, ref.logprobs, got.logprobs
        ):
            assert (
                abs(ref_lp[ref_token].logprob - got_lp[got_token].logprob) < 0.1
            )  # same context, K/V rounded
            compared += 1
            if ref_token != got_token:
                break  # a near tie decided the other way: the contexts differ from here
    assert compared >= 2 * len(prompts)
    assert_all_free(full)
    assert_all_free(half)


def test_bad_kv_cache_dtypes(tiny_llama):
    with pytest.raises(ConfigError, match="kv_cache_dtype: unknown dtype"):
        make_llm(tiny_llama, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype: .* cpu and torch"):
        make_llm(tiny_llama, kv_cache_dtype="bfloat16", attention_backend="triton")
