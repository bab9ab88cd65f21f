"""Granite 4 hybrids (`granitemoehybrid`) as decoder switches, read as transformers'
GraniteMoeHybridConfig reads them:

- `layer_types` (or the older `layers_block_type`): "mamba" / "linear_attention" layers run a
  Mamba2 mixer on per-sequence state slots (engine/model/mamba2.py), the others attention on
  the paged cache; `position_embedding_type` "rope", or anything else for no rotary at all;
- every layer's MLP is a shared MLP (`shared_intermediate_size`), beside routed experts
  (`num_local_experts` of `intermediate_size`, softmax over the top-k logits) where there are
  any;
- `embedding_multiplier` scales the embeddings, `residual_multiplier` each branch before its
  residual add, `attention_multiplier` is the attention scale and the logits are divided by
  `logits_scaling`.
"""

import math
from typing import Any

from kvpager.engine.mamba2_config import mamba2_dims, mamba_layers

GRANITE_HYBRID = "granitemoehybrid"


def granite_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The dense MLP (a layer without experts) is the shared MLP: its width as the one the
    decoder reads for dense layers. Other families' configs as they are."""
    if raw.get("model_type") != GRANITE_HYBRID:
        return raw
    return {**raw, "intermediate_size_mlp": raw.get("shared_intermediate_size", 1024)}


def granite_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Granite 4 sets beyond (or instead of) the common ones."""
    num_layers = raw["num_hidden_layers"]
    num_experts = raw.get("num_local_experts", 0) or 0
    shared = raw.get("shared_intermediate_size", 1024)
    rope = raw.get("position_embedding_type", "rope") == "rope"
    return dict(
        recurrent_layers=tuple(mamba_layers(raw)[:num_layers]),
        recurrent_mixer="mamba2",
        mamba_dims=mamba2_dims({**raw, "time_step_limit": time_step_limit(raw)}),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        nope_layers=(not rope,) * num_layers,
        sparse_layers=(num_experts > 0,) * num_layers,
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 2),
        moe_intermediate_size=raw.get("intermediate_size", 1024),
        norm_topk_prob=True,  # a softmax over the top-k logits: renormalised top-k
        shared_expert_intermediate_size=shared if num_experts else 0,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
    )


def time_step_limit(raw: dict[str, Any]) -> tuple[float, float]:
    """transformers writes an infinite bound as {"__float__": "Infinity"} in config.json."""
    bounds = raw.get("time_step_limit") or (0.0, math.inf)
    return tuple(float(b["__float__"]) if isinstance(b, dict) else float(b) for b in bounds)  # type: ignore[return-value]
