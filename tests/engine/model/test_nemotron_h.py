"""Nemotron-H (`nemotron_h`) greedy-equal to transformers' `generate`, token for token, in fp32
(tests/model_families.py: build_nemotron_h): one mixer a layer by pattern, Mamba2 layers on
state slots, an attention layer without RoPE on the paged cache, a relu2 MLP and grouped
sigmoid MoE layers with a shared expert. The recurrent hybrids' checks
(tests/engine/model/hybrid_checks.py): roomy, chunked prefill, recompute preemption with
small chunks, n > 1 and beams, a repeated prompt served from a state snapshot, bf16; every
block and state slot is free after each run."""

import pytest
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import CheckpointError, ConfigError

from tests.engine.model import hybrid_checks as checks
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_nemotron_h


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    path = build_nemotron_h(tmp_path_factory.mktemp("nemotron"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(nemotron):
    config = ModelConfig.from_path(nemotron[0])
    assert config.layer_blocks == ("mixer", "mixer", "mlp", "mlp", "mixer", "mlp")
    assert config.recurrent_layers == (True, False, False, False, True, False)
    assert config.sparse_layers == (False, False, False, True, False, True)
    assert config.num_kv_layers == 1 and config.num_recurrent_layers == 2
    assert config.attention_scale == 16**-0.5 and config.nope_layers == (True,) * 6
    assert (config.hidden_act, config.gated_mlp, config.rms_norm_eps) == ("relu2", False, 1e-5)
    assert config.expert_groups == (2, 1) and config.routed_scaling_factor == 1.5
    assert config.shared_expert_intermediate_size == 40


def test_a_pattern_string_reads_as_its_list():
    """NVIDIA's config.json spells the layout `hybrid_override_pattern`; transformers 5 writes
    `layers_block_type`: both read alike, and a served model is one rank only."""
    raw = dict(model_type="nemotron_h", vocab_size=384, hidden_size=64, intermediate_size=48,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
               mamba_head_dim=16, n_groups=2, ssm_state_size=8, n_routed_experts=4,
               moe_intermediate_size=32, moe_shared_expert_intermediate_size=40,
               attention_bias=True)  # fmt: skip
    by_pattern = ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M-M*E"})
    kinds = ["linear_attention", "mlp", "linear_attention", "full_attention", "moe"]
    assert by_pattern == ModelConfig.from_dict({**raw, "layers_block_type": kinds})
    assert by_pattern.num_layers == 5 and not by_pattern.attention_bias
    with pytest.raises(ConfigError, match="one rank"):
        by_pattern.check_tensor_parallel(2)
    with pytest.raises(CheckpointError, match="pattern"):
        ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M-X"})
    with pytest.raises(CheckpointError, match="attention layer"):
        ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M-ME"})
    with pytest.raises(CheckpointError, match="moe_latent_size"):
        ModelConfig.from_dict({**raw, "hybrid_override_pattern": "M*", "moe_latent_size": 16})


def test_roomy_matches_transformers(nemotron):
    checks.check_roomy(*nemotron)


def test_chunked_prefill_resumes_from_the_state(nemotron):
    checks.check_chunked(*nemotron, chunk=5)


def test_recompute_preemption_with_small_chunks(nemotron):
    checks.check_recompute(*nemotron, num_blocks=16, chunk=6, seqs=4)


def test_parallel_samples_copy_the_state(nemotron):
    path, prompts, expected = nemotron
    checks.check_parallel_samples(path, prompts[-2], expected[-2])


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(nemotron, width):
    checks.check_beams(nemotron[0], width)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(nemotron):
    checks.check_repeated_prompt(nemotron[0])


@pytest.fixture(scope="module")
def nemotron_variant(tmp_path_factory):
    """A second layout: attention first, two MLP layers in a row, MoE of 6 experts in 3
    groups (2 kept, top 3, not renormalised), a Mamba layer last with one group, no conv bias,
    longer scan chunks; `tie_word_embeddings` set, which transformers' NemotronH ignores (its
    lm_head is its own). (transformers' cache cannot start with an MLP layer.)"""
    path = build_nemotron_h(
        tmp_path_factory.mktemp("nemotron_variant"), seed=22, hybrid_override_pattern="*M--E*M",
        n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=3,
        norm_topk_prob=False, routed_scaling_factor=0.7, n_groups=1, use_conv_bias=False,
        chunk_size=8, tie_word_embeddings=True,
    )  # fmt: skip
    prompts = make_prompts(seed=3)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_a_second_layout_matches_transformers(nemotron_variant):
    config = ModelConfig.from_path(nemotron_variant[0])
    assert config.layer_blocks[2:4] == ("mlp", "mlp") and config.num_kv_layers == 2
    assert not config.tie_word_embeddings
    checks.check_roomy(*nemotron_variant)
    checks.check_recompute(*nemotron_variant, num_blocks=12, chunk=5, seqs=3)


@pytest.mark.parametrize("variant", ["nemotron", "nemotron_variant"])
def test_weights_are_what_kv_size_counts(request, variant):
    """One block a layer, ungated MLPs and experts, fp32 norms and router."""
    checks.check_weights_counted(request.getfixturevalue(variant)[0])


def test_bf16_greedy_follows_transformers(nemotron):
    """The norm weights rounded to bf16 at load, scaled in fp32 (as transformers holds and
    scales them)."""
    checks.check_bf16(nemotron[0])
