"""Nemotron-H (`nemotron_h`) greedy-equal to transformers' `generate`, token for token, in fp32
(tests/model_families.py: build_nemotron_h): one mixer a layer by pattern, Mamba2 layers on
state slots, an attention layer without RoPE on the paged cache, a relu2 MLP and grouped
sigmoid MoE layers with a shared expert. Roomy, under chunked prefill, under recompute
preemption with small chunks, with n > 1 and beams, a repeated prompt served from a state
snapshot; every block and state slot is free after each run."""

import json

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError, ConfigError

from tests.engine.helpers import hf_generate, make_llm, random_prompts
from tests.engine.model.test_bf16 import MAX_TOKENS as BF16_TOKENS
from tests.engine.model.test_bf16 import assert_follows_transformers
from tests.engine.model.test_granite_hybrid import assert_slots_free, greedy
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
    path, prompts, expected = nemotron
    with make_llm(path, num_blocks=256) as llm:
        assert isinstance(llm.scheduler.block_manager, RecurrentBlockManager)
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_slots_free(llm)


def test_chunked_prefill_resumes_from_the_state(nemotron):
    path, prompts, expected = nemotron
    with make_llm(path, max_num_batched_tokens=5, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == expected
        assert_slots_free(llm)


def test_recompute_preemption_with_small_chunks(nemotron):
    path, prompts, expected = nemotron
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute", enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)


def test_parallel_samples_copy_the_state(nemotron):
    path, prompts, expected = nemotron
    with make_llm(path, max_num_batched_tokens=16) as llm:
        params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([prompts[-2]], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [expected[-2]] * 3
        assert_slots_free(llm)


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(nemotron, width):
    path = nemotron[0]
    prompts = random_prompts([1, 6, 17], seed=5)
    with make_llm(path) as llm:
        params = SamplingParams(beam_width=width, temperature=0.0, max_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)]
        expected = hf_generate(path, prompts, max_new_tokens=8, num_beams=width, do_sample=False)
        assert got == expected
        assert_slots_free(llm)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(nemotron):
    """A second request with the same 64-token prompt reports 56 cached tokens (7 of its 8
    blocks; the last token is always computed) and the same output."""
    path = nemotron[0]
    prompt = random_prompts([64], seed=11)[0]
    expected = hf_greedy(path, [prompt], MAX_TOKENS)
    with make_llm(path, num_blocks=64) as llm:
        assert greedy(llm, [prompt]) == expected
        first = llm.stats()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        second = llm.generate([prompt], params, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == expected[0]
        assert second.num_cached_tokens == 56
        stats = llm.stats()
        assert stats["prefix_cache_hit_tokens"] - first["prefix_cache_hit_tokens"] == 56
        assert stats["state_snapshot_hits"] == 1 and stats["state_snapshot_hit_tokens"] == 56
        assert_slots_free(llm)


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
    path, prompts, expected = nemotron_variant
    config = ModelConfig.from_path(path)
    assert config.layer_blocks[2:4] == ("mlp", "mlp") and config.num_kv_layers == 2
    assert not config.tie_word_embeddings
    with make_llm(path) as llm:
        assert greedy(llm, prompts) == expected
        assert_slots_free(llm)
    with make_llm(
        path, num_blocks=12, max_num_batched_tokens=5, max_num_seqs=3,
        preemption_mode="recompute", enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_slots_free(llm)


@pytest.mark.parametrize("variant", ["nemotron", "nemotron_variant"])
def test_weights_are_what_kv_size_counts(request, variant):
    """Every checkpoint tensor has its place, and the memory budget counts what the decoder
    holds: one block a layer, ungated MLPs and experts, fp32 norms and router."""
    path = request.getfixturevalue(variant)[0]
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, path)
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)
    assert json.loads((path / "config.json").read_text())["model_type"] == "nemotron_h"


def test_bf16_greedy_follows_transformers(nemotron):
    """bf16: each greedy token within test_bf16.py's tie margin of transformers' bf16 best,
    up to the first near tie."""
    path = nemotron[0]
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    with make_llm(path, dtype="bfloat16") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_follows_transformers(path, prompts, outputs)
        assert_slots_free(llm)
