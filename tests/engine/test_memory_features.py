"""Prefix sharing, parallel sampling, beam search and swap, proven by counting blocks."""

import pytest
from kvpager.engine import SamplingParams

from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


def test_shared_system_prompt_is_stored_once(tiny_llama):
    system = random_prompts([32], seed=1)[0]  # 4 full blocks of 8
    suffixes = random_prompts([3] * 16, seed=2)
    prompts = [system + s for s in suffixes]
    llm = make_llm(tiny_llama)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.stats()
    # each request computes 32 + 3 + 5 - 1 = 39 tokens: 4 shared blocks + 1 of its own
    assert stats["peak_used_blocks"] == 4 + 16
    assert stats["prefix_cache_hit_tokens"] == 15 * 32
    assert [o.num_cached_tokens for o in outs] == [0] + [32] * 15
    assert_all_free(llm)
    plain = make_llm(tiny_llama, enable_prefix_caching=False)
    plain_outs = plain.generate(prompts, GREEDY)
    assert plain.stats()["peak_used_blocks"] == 16 * 5
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [o.outputs[0].token_ids for o in plain_outs]
    assert (
        got == hf_generate(tiny_llama, prompts[:4], max_new_tokens=5, do_sample=False)[:4] + got[4:]
    )
    assert_all_free(plain)


def test_parallel_samples_fork_and_copy_on_write(tiny_llama):
    prompt = random_prompts([13], seed=3)[0]  # ends inside block 1: its tail is shared
    llm = make_llm(tiny_llama)
    params = SamplingParams(n=4, temperature=0.9, seed=100, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    stats = llm.stats()
    assert stats["num_block_copies"] == 3  # all but the last writer copy the shared tail
    # each sample holds 13 + 12 - 1 = 24 computed tokens, 3 blocks: block 0 shared by all,
    # its own copy of the prompt's tail block (the last writer keeps the original), block 2
    assert stats["peak_used_blocks"] == 1 + 4 * 2
    for index, completion in enumerate(out.outputs):
        alone = SamplingParams(temperature=0.9, seed=100 + index, max_tokens=12, ignore_eos=True)
        single = llm.generate([prompt], alone)[0].outputs[0]
        assert completion.token_ids == single.token_ids, index
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_free(llm)


def test_greedy_samples_all_equal_transformers(tiny_qwen2):
    prompt = random_prompts([10], seed=4)[0]
    llm = make_llm(tiny_qwen2)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=8))[0]
    expected = hf_generate(tiny_qwen2, [prompt], max_new_tokens=8, do_sample=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert_all_free(llm)


def test_samples_fork_after_a_chunked_prompt_with_budget_left(tiny_qwen2):
    """The last prompt chunk (8 of 40 tokens, budget 16) leaves budget in the forking step:
    the new samples must not be scheduled in it (the executor has not made them yet)."""
    prompt = random_prompts([40], seed=5)[0]
    llm = make_llm(tiny_qwen2, max_num_batched_tokens=16)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=6))[0]
    expected = hf_generate(tiny_qwen2, [prompt], max_new_tokens=6, do_sample=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert_all_free(llm)


@pytest.mark.parametrize(
    "width,length_penalty,early_stopping", [(4, 1.0, False), (3, 0.5, True), (2, 2.0, False)]
)
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_beam_search_equals_transformers(request, model, width, length_penalty, early_stopping):
    path = request.getfixturevalue(model)
    prompts = random_prompts([1, 6, 9, 17], seed=5)
    llm = make_llm(path)
    params = SamplingParams(
        beam_width=width,
        temperature=0.0,
        max_tokens=10,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params)]
    expected = hf_generate(
        path,
        prompts,
        max_new_tokens=10,
        num_beams=width,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    assert got == expected
    assert_all_free(llm)


def test_beams_share_blocks(tiny_llama):
    prompt = random_prompts([40], seed=6)[0]  # 5 blocks of prompt
    llm = make_llm(tiny_llama)
    llm.beam_search([prompt], SamplingParams(beam_width=4, temperature=0.0, max_tokens=10))
    peak = llm.stats()["peak_used_blocks"]
    # unshared, 4 beams would hold 4 x 7 blocks (49 tokens); sharing the prompt keeps
    # them within the 5 prompt blocks plus at most 2 private blocks a beam
    assert peak <= 5 + 4 * 2
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_greedy_identical_under_swap_and_recompute(tiny_llama, mode):
    prompts = random_prompts([1, 5, 9, 12, 17, 23, 31, 41], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_llama).generate(prompts, params)]
    llm = make_llm(
        tiny_llama,
        num_blocks=8,
        swap_space=1 << 20,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode in ("swap", "auto"):  # on a CPU device auto swaps single sequences too
        assert stats["num_swap_preemptions"] > 0
        assert stats["num_swapped_out_blocks"] == stats["num_swapped_in_blocks"] > 0
    if mode == "recompute":
        assert stats["num_swap_preemptions"] == 0
    # parallel samples under pressure: auto swaps them rather than recomputing
    outs = llm.generate(prompts[:4], SamplingParams(n=3, temperature=0.0, max_tokens=16))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e] * 3 for e in expected[:4]]
    if mode != "recompute":
        assert llm.stats()["num_swap_preemptions"] > stats["num_swap_preemptions"]
    assert_all_free(llm)


def test_evicted_prefix_blocks_come_back_from_cpu(tiny_llama):
    system = random_prompts([32], seed=8)[0]
    llm = make_llm(tiny_llama, num_blocks=11, swap_space=1 << 20)
    first = llm.generate([system + [40, 41]], GREEDY)[0]
    # 80 + 5 - 1 computed tokens take all 11 blocks: the 4 cached ones move to the CPU pool
    llm.generate(random_prompts([80], seed=9), GREEDY)
    stats = llm.stats()
    assert stats["num_evictions"] == stats["num_swapped_out_blocks"] == 4
    again = llm.generate([system + [40, 41]], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert llm.stats()["num_swapped_in_blocks"] == 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_free(llm)
