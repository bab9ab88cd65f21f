"""What each supported `model_type` switches on in the one decoder, read from config.json.

Every family is the Llama decoder plus a few switches (see engine/model/decoder.py):

    llama, mistral, qwen2   the base (qwen2: q/k/v bias; mistral: a window on every layer)
    qwen3, qwen3_moe        per-head RMSNorm on q and k; qwen3_moe: top-k routed experts
    gemma2, gemma3_text     GeGLU, (1 + w) norms, sandwich norms around attention and MLP,
                            embeddings times sqrt(hidden), query_pre_attn_scalar, soft-capping,
                            sliding and full layers; gemma3: q/k norms, a local RoPE base
    phi3                    fused qkv_proj / gate_up_proj in the checkpoint, longrope
    mixtral                 top-k routed experts, always renormalised over the top k
    gpt_oss                 attention sinks, q/k/v/o bias, sliding and full layers, YaRN, routed
                            experts: a router with bias, softmax over the top-k logits, biased
                            experts with a clamped SwiGLU (engine/model/gpt_oss.py)
    llama4_text             chunked local attention and NoPE layers, QK L2 norm, interleaved
                            MoE with a shared expert (engine/llama4_family.py)
    deepseek_v3             multi-head latent attention on latent pages, grouped sigmoid MoE
                            with shared experts (engine/deepseek_family.py)
    deepseek_v2             the same attention, softmax (optionally group-limited) routing
    granitemoehybrid        Mamba2 layers on state slots beside attention layers (RoPE or
                            none), MoE with a shared MLP, multipliers (engine/mamba2_config.py)
    qwen3_next              gated DeltaNet layers on state slots beside gated attention with
                            partial RoPE, (1 + w) norms, MoE with a gated shared expert
                            (engine/families/qwen3_next.py)
    qwen3_5_text            Qwen3-Next's layers with flat DeltaNet projections and a dense MLP;
    qwen3_5_moe_text        the same with experts and a gated shared expert on every layer;
                            both also the text part of multimodal qwen3_5 / qwen3_5_moe checkpoints
                            (engine/families/qwen3_5.py)
    nemotron_h              one mixer a layer by pattern: Mamba2 on state slots, attention
                            without RoPE, relu2 MLPs, grouped sigmoid MoE with a shared expert
                            (engine/families/nemotron_h.py)

Plain functions of the raw dict, so engine/config.py imports this and nothing imports back.
"""

from typing import Any

from kvpager.engine.deepseek_family import DEEPSEEK, DEEPSEEK_V2, DEEPSEEK_V3, deepseek_fields
from kvpager.engine.families.nemotron_h import NEMOTRON_H, nemotron_fields
from kvpager.engine.families.qwen3_5 import QWEN3_5_MOE_TEXT, QWEN3_5_TYPES, qwen3_5_fields
from kvpager.engine.families.qwen3_next import QWEN3_NEXT, qwen3_next_fields
from kvpager.engine.llama4_family import LLAMA4_TEXT, llama4_fields
from kvpager.engine.mamba2_config import GRANITE_HYBRID, granite_fields

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "gpt_oss",
    LLAMA4_TEXT,
    DEEPSEEK_V3,
    DEEPSEEK_V2,
    GRANITE_HYBRID,
    QWEN3_NEXT,
    *QWEN3_5_TYPES,
    NEMOTRON_H,
)
GEMMA = ("gemma2", "gemma3_text")
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_next", *QWEN3_5_TYPES)
MOE = ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_next", QWEN3_5_MOE_TEXT)


def family_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's per-family switches, as ModelConfig fields."""
    model_type = raw.get("model_type", "")
    num_layers = raw["num_hidden_layers"]
    gemma = model_type in GEMMA
    fields = dict(
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        qk_norm=model_type in QK_NORM,
        gemma_norms=gemma,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
        # transformers' Gemma 3 leaves attn_logit_softcapping unused; follow it
        attn_logit_softcapping=raw.get("attn_logit_softcapping")
        if model_type == "gemma2"
        else None,
        final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
        layer_windows=layer_windows(raw, num_layers),
        local_rope_theta=_local_rope_theta(raw),
        partial_rotary_factor=rope_params(raw).get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)
        ),
        **_moe_fields(raw, model_type, num_layers),
        **_gpt_oss_fields(raw, model_type),
    )
    if model_type in DEEPSEEK:
        return {**fields, **deepseek_fields(raw)}
    if model_type == GRANITE_HYBRID:
        return {**fields, **granite_fields(raw)}
    if model_type == QWEN3_NEXT:
        return {**fields, **qwen3_next_fields(raw)}
    if model_type in QWEN3_5_TYPES:
        return {**fields, **qwen3_5_fields(raw)}
    if model_type == NEMOTRON_H:
        return {**fields, **nemotron_fields(raw)}
    return {**fields, **llama4_fields(raw)} if model_type == LLAMA4_TEXT else fields


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens, 0 for full attention."""
    window = raw.get("sliding_window") or 0
    model_type = raw.get("model_type", "")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        return (0,) * num_layers
    types = raw.get("layer_types")
    if types is None and model_type in ("gemma2", "gpt_oss"):  # sliding first, alternating
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if types is None and model_type == "gemma3_text":
        pattern = raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
    if types is None and model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = raw.get("max_window_layers", num_layers)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    if types is None:
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in types[:num_layers])


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of the full-attention layers (or the only ones)."""
    params = raw.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _local_rope_theta(raw: dict[str, Any]) -> float | None:
    """Gemma 3's RoPE base of its sliding layers (`rope_local_base_freq`, or transformers 5's
    per-layer-type `rope_parameters`)."""
    if raw.get("model_type") != "gemma3_text":
        return None
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))


def _moe_fields(raw: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    if model_type not in MOE:
        return dict(sparse_layers=(False,) * num_layers)
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(
        num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
    )
    return dict(
        sparse_layers=sparse,
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        # Mixtral's experts are intermediate_size wide; Qwen3-MoE's moe_intermediate_size
        moe_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        # a missing norm_topk_prob reads as each config class's default
        norm_topk_prob=model_type == "mixtral"
        or raw.get("norm_topk_prob", model_type == "qwen3_next"),
    )


def _gpt_oss_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """gpt-oss's switches: sinks, an o_proj bias, float32 norm weights (transformers keeps
    them in fp32 and scales before the one rounding, as Gemma's), and its experts."""
    if model_type != "gpt_oss":
        return {}
    return dict(
        attention_sinks=True,
        o_proj_bias=raw.get("attention_bias", True),
        float32_norms=True,
        gpt_oss_experts=True,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
