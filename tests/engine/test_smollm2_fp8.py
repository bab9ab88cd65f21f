"""The issue's done-when on the real default model: at the same kv_cache_memory an fp8 (e4m3)
cache holds at least 1.9x the blocks of the bf16 one, and its greedy outputs over 8 chat
prompts x 64 tokens are close in vLLM's check_logprobs_close sense (benchmarks/engine/fp8_cache.py
prints the details on the same prompts, e5m2 too)."""

import pytest
from kvpager.engine import SamplingParams

from tests.engine.helpers import assert_all_free, make_llm
from tests.engine.worker.test_fp8_cache import check_logprobs_close

pytestmark = pytest.mark.slow

CHATS = [  # benchmarks/engine/fp8_cache.py's prompts
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain what a hash table is in two sentences.",
    "List three uses of a paged KV cache.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish and French.",
]


def test_fp8_cache_doubles_the_blocks_and_stays_close(smollm2_path):
    caches = {}
    for kv_cache_dtype in ("auto", "fp8"):
        caches[kv_cache_dtype] = make_llm(
            smollm2_path,
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            num_blocks=None,
            kv_cache_memory=64 << 20,
            block_size=16,
            attention_backend="cpu",
        )
    assert caches["fp8"].executor.num_blocks >= 1.9 * caches["auto"].executor.num_blocks
    # 8 logprobs, not 5: a summation order's last bits (the prefill kernel against the decode
    # rows) move some fp8 roundings, and on one of 512 tokens the two runs' choices then fell
    # outside each other's top 5 (within the top 8)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=8)
    chats = [[{"role": "user", "content": chat}] for chat in CHATS]
    expected, got = (llm.chat(chats, params) for llm in caches.values())
    assert check_logprobs_close(expected, got, top=8) >= 64  # of 512: most differ early, but close
    for llm in caches.values():
        assert_all_free(llm)
