"""Tiny seeded Qwen3.5 checkpoints (`qwen3_5_text`, `qwen3_5_moe_text`, and the multimodal
`qwen3_5` / `qwen3_5_moe` with a one-block vision tower), built as tests/model_families.py
builds the others, and transformers' greedy outputs of them by the class each loads with."""

from pathlib import Path

import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from tests.engine.model.test_parity import hf_greedy
from tests.model_families import save_deltanet_model
from tests.models import _common, train_tokenizer

# variant -> (text config, causal LM, multimodal config or None, its model class or None)
VARIANTS = {
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, None, None),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, None, None),
    "qwen3_5": (Qwen3_5TextConfig, None, Qwen3_5Config, Qwen3_5ForConditionalGeneration),
    "qwen3_5_moe": (
        Qwen3_5MoeTextConfig,
        None,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    ),
}
MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)  # fmt: skip
# a tiny vision tower, only so the checkpoint has one (kvpager skips it)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4,
              out_hidden_size=64, num_position_embeddings=16)  # fmt: skip


def text_fields(variant: str, tokenizer) -> dict:
    """Gated DeltaNet layers 0 and 2 (2 key heads, 4 value heads of 16, conv 4) before gated
    attention layers 1 and 3, RoPE on a quarter of each head as interleaved M-RoPE; a dense
    MLP 40 wide, or (moe) 4 experts of 32, top 2, with a gated shared expert 48 wide."""
    fields = dict(_common(tokenizer), num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=40,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * 2,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                       partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                       mrope_interleaved=True))  # fmt: skip
    if "moe" in variant:
        del fields["intermediate_size"]  # every layer is MoE
        fields.update(MOE_FIELDS)
    return fields


def build_qwen3_5(path: Path, variant: str, seed: int = 15, tied: bool = False, **overrides):
    """A tiny checkpoint of `variant` (a VARIANTS key); `tied`: lm_head is the embedding."""
    text_config_cls, causal_cls, multimodal_cls, multimodal_model = VARIANTS[variant]
    tokenizer = train_tokenizer(path)
    text = {**text_fields(variant, tokenizer), **overrides}
    torch.manual_seed(seed)
    if multimodal_cls is None:
        model = causal_cls(text_config_cls(**text, tie_word_embeddings=tied))
    else:
        config = multimodal_cls(
            text_config=text, vision_config=VISION, tie_word_embeddings=tied,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        model = multimodal_model(config)
    return save_deltanet_model(model, path)


def hf_greedy_by_class(path: Path, variant: str, prompts, max_tokens: int) -> list[list[int]]:
    """transformers' greedy new tokens by the variant's own class (a multimodal checkpoint:
    its ForConditionalGeneration on text alone)."""
    _, causal_cls, _, multimodal_model = VARIANTS[variant]
    return hf_greedy(path, prompts, max_tokens, multimodal_model or causal_cls)
