"""Llama 4 text (`llama4_text`, or the `text_config` of a `llama4` checkpoint) as decoder
switches, read as transformers' Llama4TextConfig reads them:

- `no_rope_layers[i]` 1: layer i uses RoPE (and, with `attention_chunk_size`, attends within
  its chunk); 0: a NoPE layer with full attention. Unset: every `no_rope_layer_interval`-th
  layer is NoPE. `layer_types`, where the config has them, say which layers are chunked.
- RoPE rotates adjacent pairs (complex multiplication); the loader reorders q / k rows so the
  rotate-half kernels compute the same (engine/model/loader.py).
- `use_qk_norm`: a weightless RMSNorm of q and k after RoPE, on RoPE layers only.
- `attn_temperature_tuning`: NoPE layers scale q by log1p(floor((p + 1) / floor_scale)) *
  attn_scale + 1 at position p.
- MoE on `moe_layers` (default every `interleave_moe_layer_step`-th layer): a sigmoid of the
  top-k router logits scales each chosen expert's input, and a shared expert is added; experts
  and the shared expert are `intermediate_size` wide, dense layers `intermediate_size_mlp`.
"""

from typing import Any

LLAMA4_TEXT = "llama4_text"


def llama4_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal `llama4` config's text part as a `llama4_text` one; others as they are."""
    if raw.get("model_type") != "llama4":
        return raw
    return {**raw.get("text_config", {}), "model_type": LLAMA4_TEXT}


def llama4_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Llama 4 sets beyond (or instead of) the common ones."""
    num_layers = raw["num_hidden_layers"]
    rope = _rope_layers(raw, num_layers)
    chunk = raw.get("attention_chunk_size", 8192)
    types = raw.get("layer_types") or [
        "chunked_attention" if uses_rope and chunk else "full_attention" for uses_rope in rope
    ]
    step = raw.get("interleave_moe_layer_step", 1) or 1
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        moe_layers = range(step - 1, num_layers, step)
    tuning = raw.get("attn_temperature_tuning", True)
    return dict(
        layer_windows=tuple(-chunk if kind == "chunked_attention" else 0 for kind in types),
        nope_layers=tuple(not uses_rope for uses_rope in rope),
        rope_interleaved=True,
        qk_l2_norm=raw.get("use_qk_norm", True),
        attn_temperature=(float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1)))
        if tuning
        else None,
        sparse_layers=tuple(i in set(moe_layers) for i in range(num_layers)),
        num_experts=raw.get("num_local_experts", 16),
        num_experts_per_tok=raw.get("num_experts_per_tok", 1),
        moe_intermediate_size=raw["intermediate_size"],
        shared_expert_intermediate_size=raw["intermediate_size"],
        moe_router="llama4",
    )


def _rope_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    """Per layer: whether it uses RoPE (transformers' `no_rope_layers`, 1 = uses it)."""
    flags = raw.get("no_rope_layers")
    if not flags:
        interval = raw.get("no_rope_layer_interval", 4)
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    return [bool(flag) for flag in flags[:num_layers]]
