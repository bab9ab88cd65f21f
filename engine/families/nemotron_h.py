"""NVIDIA Nemotron-H (`nemotron_h`) as decoder switches, read as transformers' NemotronHConfig
reads them.

Each layer is one residual block, a pre-norm and a single mixer, chosen by
`hybrid_override_pattern` (or transformers 5's `layers_block_type`):

    M  "linear_attention"  a Mamba2 mixer on state slots (engine/model/mamba2.py, as Granite 4's)
    *  "full_attention"    attention on the paged cache, without RoPE, scale head_dim^-0.5
    -  "mlp"               up_proj -> relu2 -> down_proj (no gate)
    E  "moe"               DeepSeek V3's grouped sigmoid router (with e_score_correction_bias,
                           `n_group` / `topk_group`, `norm_topk_prob`, `routed_scaling_factor`)
                           over relu2 experts, beside a relu2 shared expert

The decoder runs an M or * layer as the first block of its two (`layer_blocks` "mixer") and a
- or E layer as the second ("mlp"), so the one decoder serves it. The norms keep their weight
in float32 and round once, as NemotronHRMSNorm. The checkpoint's names (`backbone.` or
transformers' `model.`, `mixer.`, `norm.`) are read as the engine's (`checkpoint_name`).
"""

from typing import Any

from kvpager.engine.mamba2_config import mamba2_dims, time_step_limit
from kvpager.schemas.errors import CheckpointError

NEMOTRON_H = "nemotron_h"
# older spellings NemotronHConfig still reads, which win over the current names (as there)
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
PATTERN_KINDS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def layer_pattern(raw: dict[str, Any]) -> str:
    """One character a layer (the module docstring), from either spelling of the layout."""
    kinds = raw.get("layers_block_type") or raw.get("layer_types")
    pattern = raw.get("hybrid_override_pattern") or "".join(
        PATTERN_KINDS.get(kind, "?") for kind in kinds or ()
    )
    if not pattern or set(pattern) - set("M*-E"):
        raise CheckpointError(f"nemotron_h: unreadable layer pattern {pattern!r}")
    return pattern


def nemotron_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The common fields as the decoder reads them: a layer a pattern character, the norms'
    epsilon; no q/k/v bias, no window and an lm_head of its own, whatever `attention_bias`,
    `sliding_window` and `tie_word_embeddings` say (transformers' NemotronH has none of
    them); the older field names (ALIASES) as the current ones; other families' configs as
    they are."""
    if raw.get("model_type") != NEMOTRON_H:
        return raw
    raw = {**raw, **{name: raw[alias] for alias, name in ALIASES.items() if alias in raw}}
    if raw.get("moe_latent_size") or raw.get("mlp_bias"):
        raise CheckpointError("nemotron_h: moe_latent_size and mlp_bias are not supported")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise CheckpointError("nemotron_h: a Mamba activation other than silu is not supported")
    return {
        **raw,
        "num_hidden_layers": len(layer_pattern(raw)),
        "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "sliding_window": None,  # full attention: transformers' NemotronH reads no window
        "hidden_act": raw.get("mlp_hidden_act", "relu2"),
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
    }


def nemotron_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Nemotron-H sets beyond (or instead of) the common ones."""
    pattern = layer_pattern(raw)
    num_experts = raw.get("n_routed_experts", 8)
    return dict(
        layer_blocks=tuple("mixer" if kind in "M*" else "mlp" for kind in pattern),
        gated_mlp=False,
        recurrent_layers=tuple(kind == "M" for kind in pattern),
        recurrent_mixer="mamba2",
        mamba_dims=mamba2_dims({**raw, "time_step_limit": time_step_limit(raw)}),
        mamba_proj_bias=bool(raw.get("use_bias", False)),
        mamba_conv_bias=bool(raw.get("use_conv_bias", True)),
        nope_layers=(True,) * len(pattern),
        float32_norms=True,
        sparse_layers=tuple(kind == "E" for kind in pattern),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        moe_intermediate_size=raw.get("moe_intermediate_size", 7688),
        # one shared expert of this width (transformers reads no n_shared_experts)
        shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size", 7688),
        norm_topk_prob=raw.get("norm_topk_prob", True),
        moe_router="deepseek",
        expert_groups=(raw.get("n_group") or 1, raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


def checkpoint_name(name: str, layer_blocks: tuple[str, ...], recurrent: tuple[bool, ...]) -> str:
    """A Nemotron-H checkpoint tensor's name as the engine's loader reads it (decoder.py's
    two blocks: `input_layernorm` / `post_attention_layernorm`, `self_attn.`, `mamba.`,
    `mlp.`); names it does not know pass unchanged (and are refused there)."""
    name = name.removeprefix("backbone.").removeprefix("model.")
    renamed = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
    if name in renamed or not name.startswith("layers."):
        return renamed.get(name, name)
    _, idx, rest = name.split(".", 2)
    if not idx.isdigit() or int(idx) >= len(layer_blocks):
        return name
    mixer = layer_blocks[int(idx)] == "mixer"
    if rest == "norm.weight":
        return f"layers.{idx}.{'input' if mixer else 'post_attention'}_layernorm.weight"
    group = ("mamba" if recurrent[int(idx)] else "self_attn") if mixer else "mlp"
    if rest.startswith("mixer."):
        return f"layers.{idx}.{group}.{rest.removeprefix('mixer.')}"
    return name
