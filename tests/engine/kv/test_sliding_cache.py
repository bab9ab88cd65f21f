"""Sliding windows in the paged cache, end to end: blocks that slide out of a window are freed,
so a sequence many windows long runs in a cache far smaller than its full-attention length,
and a Gemma-3-like model (five sliding layers for one full) stays greedy-equal to transformers
with one block table per KV group: roomy, preempted (recompute and swap), on prefix hits, with
n > 1 forks and a beam search. Every run ends with every block free."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.kv.hybrid_manager import HybridBlockManager

from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts
from tests.model_families import build_gemma3, build_mistral

SLIDING, FULL = "sliding_attention", "full_attention"
PROMPTS = random_prompts([3, 9, 17, 26, 33, 41], seed=11)


def greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def mistral_16(tmp_path_factory):
    return build_mistral(tmp_path_factory.mktemp("mistral-16"), seed=21, sliding_window=16)


@pytest.fixture(scope="module")
def mistral_expected(mistral_16):
    prompt = random_prompts([40], seed=5)[0]
    return prompt, hf_generate(mistral_16, [prompt], max_new_tokens=400, do_sample=False)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_sequence_25_windows_long_runs_in_8_blocks(mistral_16, mistral_expected, backend):
    """40-token prompt + 400 tokens with a 16-token window on every layer: a full cache needs
    28 blocks of 16; here 8 hold it, with no preemption, and it peaks at 3 (the window's
    blocks and the one being filled). The C kernel never reads a freed block's slot."""
    prompt, expected = mistral_expected
    llm = make_llm(
        mistral_16,
        block_size=16,
        num_blocks=8,
        max_model_len=440,
        max_num_batched_tokens=64,
        attention_backend=backend,
    )
    assert greedy(llm, [prompt], 400) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] == 0 and stats["peak_used_blocks"] == 3, stats
    assert_all_free(llm)


@pytest.fixture(scope="module")
def gemma3_mixed(tmp_path_factory):
    """6 layers, 5 sliding (window 8) for 1 full: six KV groups of one layer each."""
    path = tmp_path_factory.mktemp("gemma3-mixed")
    types = [SLIDING] * 5 + [FULL]
    return build_gemma3(path, seed=23, num_hidden_layers=6, layer_types=types)


@pytest.fixture(scope="module")
def gemma3_expected(gemma3_mixed):
    return hf_generate(gemma3_mixed, PROMPTS, max_new_tokens=24, do_sample=False)


def test_mixed_groups_roomy_and_under_recompute(gemma3_mixed, gemma3_expected):
    with make_llm(gemma3_mixed, num_blocks=256) as llm:
        manager = llm.scheduler.block_manager
        assert isinstance(manager, HybridBlockManager) and len(manager.groups) == 6
        assert [g.window for g in manager.groups] == [0, 8, 8, 8, 8, 8]
        assert greedy(llm, PROMPTS, 24) == gemma3_expected
        assert llm.stats()["num_preemptions"] == 0
        assert_all_free(llm)
    with make_llm(
        gemma3_mixed, num_blocks=30, max_num_batched_tokens=16, preemption_mode="recompute"
    ) as llm:
        assert greedy(llm, PROMPTS, 24) == gemma3_expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


def test_mixed_groups_swapped_and_prefix_hits(gemma3_mixed, gemma3_expected):
    """Swap preemption moves every group's private blocks; then prompts whose full blocks
    are cached hit: the full group on every block, the sliding ones on the window's."""
    with make_llm(
        gemma3_mixed,
        num_blocks=30,
        max_num_batched_tokens=16,
        swap_space=1 << 20,
        preemption_mode="swap",
    ) as llm:
        assert greedy(llm, PROMPTS, 24) == gemma3_expected
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0, stats
        assert stats["num_swapped_in_blocks"] > 0, stats
        assert_all_free(llm)
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        assert greedy(llm, PROMPTS[-3:], 24) == gemma3_expected[-3:]
        # 26, 33 and 41 tokens: 3 + 4 + 5 full blocks of 8 are cached by the first run
        assert llm.stats()["prefix_cache_hit_tokens"] - hits_before == (3 + 4 + 5) * 8
        assert_all_free(llm)


def test_mixed_groups_samples_and_beams(gemma3_mixed):
    """n = 3 greedy samples fork every group's table (copy-on-write of the shared tail in
    each); a beam search of width 3 forks and frees beams' tables, all equal to transformers."""
    prompt = random_prompts([13], seed=3)[0]
    with make_llm(gemma3_mixed, num_blocks=256) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=20))[0]
        expected = hf_generate(gemma3_mixed, [prompt], max_new_tokens=20, do_sample=False)
        assert [c.token_ids for c in out.outputs] == expected * 3
        assert llm.stats()["num_block_copies"] > 0
        prompts = random_prompts([6, 17], seed=5)
        params = SamplingParams(beam_width=3, temperature=0.0, max_tokens=12)
        got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)]
        beams = hf_generate(gemma3_mixed, prompts, max_new_tokens=12, num_beams=3, do_sample=False)
        assert got == beams
        assert_all_free(llm)
