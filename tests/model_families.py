"""Tiny seeded checkpoints of the families beyond Llama / Qwen2 (tests/models.py has those):
2 layers, hidden 64, the shared BPE tokenizer, every field a family switches on set so that it
matters (random norm weights where transformers starts them at 0 or 1, short windows, active
soft-caps, a query_pre_attn_scalar that is not head_dim, distinct RoPE bases)."""

from pathlib import Path

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from tests.models import _common, train_tokenizer

WINDOW = 8  # tokens: prompts of up to 41 and 20 new tokens slide far past it


def _save(model, path: Path, norm_center: float) -> Path:
    """Norm weights drawn around `norm_center` (1 for w * x norms, 0 for Gemma's (1 + w) * x)
    so they matter; transformers initialises them to exactly that."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(norm_center + 0.3 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    return path


def _build(path: Path, seed: int, config_cls, model_cls, norm_center: float, **fields) -> Path:
    tokenizer = train_tokenizer(path)
    config = config_cls(**{**_common(tokenizer), **fields})
    torch.manual_seed(seed)
    return _save(model_cls(config), path, norm_center)


def build_qwen3(path: Path, seed: int = 2, **overrides) -> Path:
    """q/k norms, head_dim 32 with 4 heads (not hidden / heads = 16), GQA 2:1, tied."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True, rope_theta=1000000.0)  # fmt: skip
    return _build(path, seed, Qwen3Config, Qwen3ForCausalLM, 1.0, **{**fields, **overrides})


def build_gemma2(path: Path, seed: int = 3, **overrides) -> Path:
    """Sliding then full layer, window 8, attention and final soft-caps that bite."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                  final_logit_softcapping=8.0, tie_word_embeddings=False)  # fmt: skip
    return _build(path, seed, Gemma2Config, Gemma2ForCausalLM, 0.0, **{**fields, **overrides})


def build_gemma3(path: Path, seed: int = 4, **overrides) -> Path:
    """Sliding then full layer; q/k norms; local base 10^4, global 10^6 with linear scaling."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    }
    fields = dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  query_pre_attn_scalar=32, sliding_window=WINDOW, rope_parameters=rope,
                  layer_types=["sliding_attention", "full_attention"],
                  final_logit_softcapping=8.0, tie_word_embeddings=False)  # fmt: skip
    return _build(path, seed, Gemma3TextConfig, Gemma3ForCausalLM, 0.0, **{**fields, **overrides})


def build_mistral(path: Path, seed: int = 5, **overrides) -> Path:
    """A window of 8 on every layer."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    return _build(path, seed, MistralConfig, MistralForCausalLM, 1.0, **{**fields, **overrides})


def build_phi3(path: Path, seed: int = 6, original_length: int = 64, **overrides) -> Path:
    """Fused qkv_proj / gate_up_proj, LongRoPE with a pre-training length of
    `original_length` tokens (64: the parity tests' sequences stay within it, on the short
    factors; 32: they cross it), a window of 2047 as Phi-3-mini-4k has (never reached here)."""
    half = 8  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}  # fmt: skip
    fields = dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                  sliding_window=2047)  # fmt: skip
    fields["original_max_position_embeddings"] = original_length
    return _build(path, seed, Phi3Config, Phi3ForCausalLM, 1.0, **{**fields, **overrides})


def build_mixtral(path: Path, seed: int = 7, **overrides) -> Path:
    """4 experts, top 2 (always renormalised)."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=64)  # fmt: skip
    return _build(path, seed, MixtralConfig, MixtralForCausalLM, 1.0, **{**fields, **overrides})


def build_qwen3_moe(path: Path, seed: int = 8, **overrides) -> Path:
    """6 experts, top 2, not renormalised; layer 1 dense (mlp_only_layers); q/k norms."""
    fields = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                  mlp_only_layers=[1], decoder_sparse_step=1)  # fmt: skip
    return _build(path, seed, Qwen3MoeConfig, Qwen3MoeForCausalLM, 1.0, **{**fields, **overrides})


def build_gpt_oss(path: Path, seed: int = 9, bias_scale: float = 1.0, **overrides) -> Path:
    """4 layers alternating sliding (window 8) and full, sinks, q/k/v/o bias, 4 experts top 2
    with a router bias and biased clamped-SwiGLU experts (a limit of 1.5 that the random
    weights reach), YaRN with a 16-token pre-training length (the ramp covers several dims).
    Sinks, router and expert biases drawn large enough to matter (transformers starts the
    biases at 0), times `bias_scale`."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 64.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    }
    fields = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.5,
                  rope_parameters=rope, tie_word_embeddings=False,
                  layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    tokenizer = train_tokenizer(path)
    config = GptOssConfig(**{**_common(tokenizer), **fields, **overrides})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.copy_(bias_scale * torch.randn_like(param))
    return _save(model, path, 1.0)


CHUNK = 16  # Llama 4's attention chunk: two blocks of 8, so finished chunks free blocks


def build_llama4(path: Path, seed: int = 9, **overrides) -> Path:
    """Llama 4 text: layers 0, 2, 3 chunked (16 tokens) with RoPE on adjacent pairs and the
    weightless q/k norm, layer 1 NoPE with full attention and a temperature that changes every
    4 positions; MoE (4 experts, top 1, sigmoid-scaled inputs, a shared expert) on layers 1
    and 3, dense layers 96 wide, experts 32."""
    fields = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                  no_rope_layers=[1, 0, 1, 1], attention_chunk_size=CHUNK, floor_scale=4,
                  attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                  tie_word_embeddings=False)  # fmt: skip
    return _build(path, seed, Llama4TextConfig, Llama4ForCausalLM, 1.0, **{**fields, **overrides})


def build_llama4_multimodal(path: Path, seed: int = 10) -> Path:
    """A `llama4` checkpoint (Llama4ForConditionalGeneration): build_llama4's text layers
    under `language_model.`, beside a one-layer vision tower the engine leaves unread."""
    tokenizer = train_tokenizer(path)
    text = dict(_common(tokenizer), num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=32,
                intermediate_size_mlp=96, num_local_experts=4, interleave_moe_layer_step=2,
                no_rope_layers=[1, 0, 1, 1], attention_chunk_size=CHUNK, floor_scale=4,
                attn_scale=0.5)  # fmt: skip
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32)  # fmt: skip
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision))
    return _save(model, path, 1.0)


def build_deepseek_v3(path: Path, seed: int = 11, **overrides) -> Path:
    """DeepSeek V3: latent attention (q_lora_rank 32, kv_lora_rank 24, 16 + 8 (RoPE on
    adjacent pairs) q/k dims per head, values 16), layer 0 dense, layers 1-2 MoE: 8 experts in
    4 groups, the best 2 groups kept, top 2, one shared expert; a random
    e_score_correction_bias so the groups' choice depends on it."""
    fields = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                  topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
                  n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                  tie_word_embeddings=False)  # fmt: skip
    return _build_deepseek(path, seed, DeepseekV3Config, DeepseekV3ForCausalLM,
                           {**fields, **overrides})  # fmt: skip


def build_deepseek_v2(path: Path, seed: int = 12, **overrides) -> Path:
    """DeepSeek V2: build_deepseek_v3's attention (RoPE always on adjacent pairs, complex in
    transformers), a softmax router: group-limited greedy (12 experts in 4 groups, the best
    2 by their best expert kept, top 3, times 1.5, not renormalised), two shared experts."""
    fields = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, first_k_dense_replace=1, n_routed_experts=12, n_group=4,
                  topk_group=2, num_experts_per_tok=3, moe_intermediate_size=32,
                  n_shared_experts=2, routed_scaling_factor=1.5,
                  topk_method="group_limited_greedy",
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                  tie_word_embeddings=False)  # fmt: skip
    return _build_deepseek(path, seed, DeepseekV2Config, DeepseekV2ForCausalLM,
                           {**fields, **overrides})  # fmt: skip


def _build_deepseek(path: Path, seed: int, config_cls, model_cls, fields: dict) -> Path:
    tokenizer = train_tokenizer(path)
    config = config_cls(**{**_common(tokenizer), **fields})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    return _save(model, path, 1.0)


def build_granite_hybrid(path: Path, seed: int = 13, **overrides) -> Path:
    """Granite 4 hybrid: Mamba2 layers 0 and 2 (4 heads of 16, 2 groups, state 8, conv 4,
    scan chunks of 4 tokens) around attention layer 1 with RoPE; MoE (4 experts of 32, top 2)
    beside a shared MLP 48 wide; every multiplier away from 1; random dt_bias and A_log."""
    fields = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=32, shared_intermediate_size=48, num_local_experts=4,
                  num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
                  mamba_n_heads=4, mamba_d_head=16, mamba_expand=1, mamba_n_groups=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
                  position_embedding_type="rope",
                  embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=1.5,
                  attention_multiplier=0.2, tie_word_embeddings=False)  # fmt: skip
    tokenizer = train_tokenizer(path)
    config = GraniteMoeHybridConfig(**{**_common(tokenizer), **fields, **overrides})
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "mamba.D")):
                param.copy_(torch.randn_like(param) * 0.5)
    return _save(model, path, 1.0)


def save_deltanet_model(model, path: Path) -> Path:
    """A Qwen3-Next-like model saved with weights that matter: random dt_bias and A_log,
    (1 + w) norms drawn around 0, the DeltaNet's plain gated norm around 1."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dt_bias", "A_log")):
                param.copy_(torch.randn_like(param) * 0.5)
        _save(model, path, 0.0)
        for name, param in model.named_parameters():  # plain weights: around 1
            if name.endswith("linear_attn.norm.weight"):
                param.add_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_qwen3_next(path: Path, seed: int = 14, **overrides) -> Path:
    """Qwen3-Next: gated DeltaNet layers 0 and 2 (2 key heads, 4 value heads of 16, conv 4)
    before gated attention layers 1 and 3 (RoPE on a quarter of each head); MoE (4 experts
    of 32, top 2) with a gated shared expert 48 wide, layer 1 a dense MLP; (1 + w) norms
    drawn around 0, the DeltaNet's gated norm around 1; random dt_bias and A_log."""
    fields = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=40, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  mlp_only_layers=[1], full_attention_interval=2,
                  tie_word_embeddings=False)  # fmt: skip
    tokenizer = train_tokenizer(path)
    config = Qwen3NextConfig(**{**_common(tokenizer), **fields, **overrides})
    torch.manual_seed(seed)
    return save_deltanet_model(Qwen3NextForCausalLM(config), path)


def build_nemotron_h(path: Path, seed: int = 15, **overrides) -> Path:
    """Nemotron-H: one mixer a layer by `hybrid_override_pattern`, "M*-EME": Mamba2 (4 heads of
    16, 2 groups, state 8, conv 4, scan chunks of 4 tokens), attention without RoPE (4 heads,
    2 KV heads), a relu2 MLP 48 wide, MoE (8 experts of 32 in 2 groups, the best group kept,
    top 2, sigmoid scores with a random e_score_correction_bias, times 1.5, a shared expert 40
    wide); random dt_bias, A_log and D."""
    fields = dict(hybrid_override_pattern="M*-EME", num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=48, mamba_num_heads=4,
                  mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
                  routed_scaling_factor=1.5, layer_norm_epsilon=1e-5,
                  tie_word_embeddings=False)  # fmt: skip
    tokenizer = train_tokenizer(path)
    common = {k: v for k, v in _common(tokenizer).items() if k != "num_hidden_layers"}
    config = NemotronHConfig(**{**common, **fields, **overrides})
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "mixer.D")):
                param.copy_(torch.randn_like(param) * 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
    return _save(model, path, 1.0)
