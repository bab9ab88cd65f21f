"""Qwen3-Next (`qwen3_next`) as decoder switches, read as transformers' Qwen3NextConfig reads
them. Not served end to end yet: `qwen3_next` is outside SUPPORTED_MODEL_TYPES until the
decoder runs these pieces (see `qwen3_next_fields` for what each switch selects).

- `layer_types`: "linear_attention" layers are gated DeltaNet mixers on per-sequence state
  slots (engine/model/gated_deltanet.py), "full_attention" layers gated attention on the paged
  cache (engine/model/gated_attention.py); without `layer_types`, every
  `full_attention_interval`-th layer is full attention (engine/deltanet_config.py).
- full attention: q_proj doubled into q and a per-channel output gate, q/k norms, RoPE on
  `partial_rotary_factor` of each head (0.25 in the released models).
- every norm scales by (1 + w) in float32 and rounds once (the input, post-attention, q/k and
  final norms; not the DeltaNet's gated norm, whose weight is plain).
- MoE as Qwen3-MoE's (`num_experts`, `decoder_sparse_step`, `mlp_only_layers`,
  `norm_topk_prob`: engine/model_families.py) plus a shared expert of
  `shared_expert_intermediate_size` scaled by sigmoid(h · shared_expert_gate)
  (engine/model/shared_expert_moe.py).
"""

from typing import Any

from kvpager.engine.deltanet_config import deltanet_dims, deltanet_layers

QWEN3_NEXT = "qwen3_next"


def qwen3_next_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The switches Qwen3-Next sets beyond the common fields (model_families.family_fields
    reads its MoE fields, q/k norm and partial_rotary_factor as for the other families).

    recurrent_layers / recurrent_mixer / deltanet_dims  which layers run the DeltaNet mixer
    attn_output_gate      q_proj carries the output gate (gated_attention.py)
    zero_centred_norms    (1 + w) float32 norms, without Gemma's sandwich norms
    shared_expert_gate    the shared expert's sigmoid gate (shared_expert_moe.py)
    """
    return dict(
        recurrent_layers=tuple(deltanet_layers(raw)),
        recurrent_mixer="gated_deltanet",
        deltanet_dims=deltanet_dims(raw),
        attn_output_gate=True,
        zero_centred_norms=True,
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
        shared_expert_gate=True,
    )
