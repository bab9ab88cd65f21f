"""Granite 4 hybrids (`granitemoehybrid`) greedy-equal to transformers' `generate`, token for
token, in fp32 (tests/model_families.py: build_granite_hybrid): Mamba2 layers on state slots
beside an attention layer on the paged cache, MoE beside a shared MLP, every multiplier. Roomy,
under chunked prefill (a chunk resumes from the state the last one left), under recompute
preemption with small chunks, with n > 1 and beams (a fork copies its parent's state); every
block and state slot is free after each run."""

import pytest
from kvpager.engine.model_config import ModelConfig

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model import hybrid_checks as checks
from tests.engine.model.hybrid_checks import assert_slots_free, greedy
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_granite_hybrid


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = build_granite_hybrid(tmp_path_factory.mktemp("granite"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(granite):
    config = ModelConfig.from_path(granite[0])
    assert config.recurrent_layers == (True, False, True)
    assert config.num_kv_layers == 1 and config.attention_scale == 0.2
    assert config.sparse_layers == (True,) * 3 and config.shared_expert_intermediate_size == 48
    assert (config.embedding_multiplier, config.residual_multiplier) == (2.0, 0.5)
    assert config.mamba_dims.time_step_limit == (0.0, float("inf"))


def test_roomy_matches_transformers(granite):
    checks.check_roomy(*granite)


def test_chunked_prefill_resumes_from_the_state(granite):
    checks.check_chunked(*granite, chunk=6)


def test_recompute_preemption_with_small_chunks(granite):
    checks.check_recompute(*granite, num_blocks=16, chunk=6, seqs=4)


def test_parallel_samples_copy_the_state(granite):
    path, prompts, expected = granite
    checks.check_parallel_samples(path, prompts[-2], expected[-2])


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(granite, width):
    checks.check_beams(granite[0], width)


@pytest.fixture(scope="module")
def granite_dense_nope(tmp_path_factory):
    """A second config: no RoPE, no experts (the shared MLP alone), attention first, two
    Mamba layers with one group and longer scan chunks, other multipliers."""
    path = build_granite_hybrid(
        tmp_path_factory.mktemp("granite_dense"), seed=21, num_local_experts=0,
        position_embedding_type="nope", layer_types=["attention", "mamba", "mamba"],
        mamba_n_groups=1, mamba_d_state=12, mamba_chunk_size=8, embedding_multiplier=0.7,
        residual_multiplier=1.3, logits_scaling=0.8, attention_multiplier=0.3,
    )  # fmt: skip
    prompts = make_prompts(seed=3)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_a_second_config_matches_transformers(granite_dense_nope):
    path, prompts, expected = granite_dense_nope
    config = ModelConfig.from_path(path)
    assert config.nope_layers == (True,) * 3 and not any(config.sparse_layers)
    checks.check_roomy(path, prompts, expected)
    checks.check_recompute(path, prompts, expected, num_blocks=12, chunk=5, seqs=3)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(granite):
    checks.check_repeated_prompt(granite[0])


def test_snapshots_inside_prefill_chunks_serve_a_shared_prefix(granite):
    """Chunks of 6 tokens cross block boundaries (8) inside the chunk: the mixer cuts its scan
    there. A second prompt sharing the first 40 tokens resumes after 5 blocks, exactly."""
    path = granite[0]
    shared = random_prompts([40], seed=12)[0]
    prompts = [shared + random_prompts([9], seed=13)[0], shared + random_prompts([17], seed=14)[0]]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with make_llm(path, num_blocks=64, max_num_batched_tokens=6) as llm:
        assert greedy(llm, prompts[:1]) == expected[:1]
        assert greedy(llm, prompts[1:]) == expected[1:]
        stats = llm.stats()
        assert stats["state_snapshot_hits"] == 1 and stats["state_snapshot_hit_tokens"] == 40
        assert_slots_free(llm)


def test_snapshots_go_with_their_evicted_blocks(granite):
    """A small cache evicts prefix blocks: their snapshots go too, so the snapshots held never
    outnumber the cached blocks; outputs stay exact, and a hit never outlives its state."""
    path, prompts, expected = granite
    with make_llm(path, num_blocks=20, max_num_seqs=2) as llm:
        for _ in range(2):
            assert greedy(llm, prompts) == expected
            stats = llm.stats()
            assert stats["num_evictions"] > 0 or stats["num_cached_blocks"] < 20
            assert 0 < stats["num_state_snapshots"] <= stats["num_cached_blocks"], stats
        assert_slots_free(llm)


def test_recompute_preemption_resumes_from_snapshots(granite):
    """With prefix caching on, a preempted request comes back through a prefix hit of its own
    blocks and resumes from their snapshot: still exact."""
    path, prompts, expected = granite
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute",
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["state_snapshot_hits"] > 0, stats
        assert_slots_free(llm)


@pytest.mark.parametrize("variant", ["granite", "granite_dense_nope"])
def test_weights_are_what_kv_size_counts(request, variant):
    """Every checkpoint tensor has its place (mixers, shared MLP, stacked experts), and the
    memory budget counts what the decoder holds: a Mamba2 mixer in place of attention."""
    checks.check_weights_counted(request.getfixturevalue(variant)[0])


def test_bf16_greedy_follows_transformers(granite):
    """bf16 (dt's bias and softplus in bf16, the scan and gated norm in fp32, rounded once,
    as transformers' layer): each greedy token within test_bf16.py's tie margin of
    transformers' bf16 best, up to the first near tie."""
    checks.check_bf16(granite[0])
