"""A handful of configs drawn unlike tests/model_families.py's (tests/engine/model/config_draws.py)
for deepseek_v3, deepseek_v2, gpt_oss and llama4_text, greedy-equal to transformers
(tie-guarded): roomy on the C kernels with n=2, and recompute-preempted in 5-token chunks;
every block free after each run. Some are saved as the real checkpoints ship their
config.json (`rope_scaling` with "type", `rope_theta` beside). What the engine cannot serve
is refused at load with a typed error."""

import pytest
import torch
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError, ConfigError

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.model.config_draws import (
    assert_tie_guarded,
    build,
    check_exact,
    draw,
    greedy,
    hf_reference,
)

YARN_AS_V3_SHIPS = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 16}  # fmt: skip

CASES = {
    # n_shared_experts 0: transformers saves 0-row shared experts (once a load error)
    "deepseek_v3-no-shared": ("deepseek_v3", 0, True, dict(
        draw("deepseek_v3", 0), n_shared_experts=0, q_lora_rank=None,
        rope_parameters=YARN_AS_V3_SHIPS)),
    "deepseek_v2-no-shared-tied": ("deepseek_v2", 3, False, dict(
        draw("deepseek_v2", 3), n_shared_experts=0, tie_word_embeddings=True)),
    "deepseek_v3-drawn": ("deepseek_v3", 8, True, draw("deepseek_v3", 8)),
    # hidden_act "gelu" (exact, erf): once refused
    "deepseek_v2-drawn-gelu": ("deepseek_v2", 9, True, draw("deepseek_v2", 9)),
    "llama4_text-gelu": ("llama4_text", 18, False, draw("llama4_text", 18)),
    "gpt_oss-drawn": ("gpt_oss", 16, False, draw("gpt_oss", 16)),
    "gpt_oss-as-shipped": ("gpt_oss", 17, True, draw("gpt_oss", 17)),
    # `rope_scaling` null: GptOssConfig's YaRN defaults (factor 32 over 4096), not plain RoPE
    "gpt_oss-rope-scaling-null": ("gpt_oss", 47, True, draw("gpt_oss", 47)),
    "llama4_text-drawn": ("llama4_text", 20, False, draw("llama4_text", 20)),
    "llama4_text-as-shipped": ("llama4_text", 21, True, draw("llama4_text", 21)),
    # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj biased (once refused)
    "deepseek_v3-biased": ("deepseek_v3", 1, False, dict(
        draw("deepseek_v3", 1), attention_bias=True, q_lora_rank=16, hidden_act="silu")),
    "deepseek_v2-biased-no-q-lora": ("deepseek_v2", 3, True, dict(
        draw("deepseek_v2", 3), attention_bias=True, q_lora_rank=None, hidden_act="silu")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_drawn_config_matches_transformers(case, tmp_path):
    family, seed, legacy_rope, fields = CASES[case]
    path = build(family, tmp_path, seed, fields, legacy_rope=legacy_rope)
    assert ModelConfig.from_path(path).model_type == family
    assert check_exact(path) > 0  # preempted


REFUSED = {
    "odd latent row": ("deepseek_v3", dict(kv_lora_rank=7), CheckpointError,
                       "kv_lora_rank \\+ qk_rope_head_dim must be even"),
    "biased MLPs": ("deepseek_v2", dict(mlp_bias=True), CheckpointError,
                    "deepseek_v2: mlp_bias is not supported"),
    "relu MLPs": ("llama4_text", dict(hidden_act="relu"), CheckpointError,
                  "hidden activation 'relu' is not supported"),
    "dynamic rope": ("deepseek_v2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 1e4}),
                     CheckpointError, "rope_scaling type 'dynamic' is not supported"),
    "chunk off the block grid": ("llama4_text", dict(attention_chunk_size=12), ConfigError,
                                 "chunk size 12 is not a multiple of block_size 8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_configs_the_engine_cannot_serve_are_refused_at_load(case, tmp_path):
    """transformers runs these; the engine says why it will not, before any step."""
    family, fields, error, message = REFUSED[case]
    path = build(family, tmp_path, 0, {**draw(family, 2), **fields})
    with pytest.raises(error, match=message):
        make_llm(path)


def test_biased_latent_attention_over_two_ranks(tmp_path):
    """Heads split over two gloo ranks: q_a / kv_a biases whole on each (their projections
    are every head's), o_proj's added once after the all-reduce; each rank reads what it
    holds and kv-size counts; greedy as transformers."""
    from tests.engine.worker.test_tensor_parallel import tp_llm

    fields = dict(draw("deepseek_v3", 5), attention_bias=True, hidden_act="silu",
                  num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    path = build("deepseek_v3", tmp_path, 5, fields)
    config = ModelConfig.from_path(path)
    for rank in (0, 1):
        decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"),
                          Shard.of(config, rank, 2))  # fmt: skip
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        assert (
            load_weights(decoder, path) == held == weight_bytes_per_rank(config, torch.float32, 2)
        )
    prompts = random_prompts([4, 19], seed=8)
    model, expected = hf_reference(path, prompts, 10)
    with tp_llm(path, num_blocks=64, max_num_batched_tokens=7) as llm:
        assert_tie_guarded(model, prompts, expected, greedy(llm, prompts, 10))
        assert_all_free(llm)


def test_a_multi_token_prediction_layer_past_the_last_is_left_unread(tmp_path):
    """DeepSeek V3 checkpoints carry their MTP module as layer num_hidden_layers (61 of 61:
    `model.layers.61.*`, with `num_nextn_predict_layers` 1); transformers leaves it, so does
    the loader, reading the same bytes as without it."""
    from safetensors.torch import save_file

    fields = dict(draw("deepseek_v3", 4), hidden_act="silu")
    path = build("deepseek_v3", tmp_path, 4, fields)
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    without = load_weights(decoder, path)
    mtp = f"model.layers.{config.num_layers}"
    extra = {f"{mtp}.eh_proj.weight": torch.randn(64, 128),
             f"{mtp}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(40, 64),
             f"{mtp}.mlp.experts.0.gate_proj.weight": torch.randn(16, 64)}  # fmt: skip
    save_file(extra, str(tmp_path / "mtp.safetensors"))
    assert load_weights(decoder, path) == without
    check_exact(path, lengths=(5, 21), n2=False)
