"""Qwen3-Next (`qwen3_next`) read from config.json, without torch: the gated DeltaNet layers'
geometry (the scheduler's side sizes their states with it, engine/kv/recurrent_size.py; the
model builds its mixers with it, engine/model/qwen3_next/gated_deltanet.py) and the decoder
switches, read as transformers' Qwen3NextConfig reads them (engine/model_families.py adds
them to the common fields; engine/model/qwen3_next/layer_pieces.py is how the decoder runs them).

- `layer_types`: "linear_attention" layers are gated DeltaNet mixers on per-sequence state
  slots, "full_attention" layers gated attention on the paged cache
  (engine/model/qwen3_next/gated_attention.py); without `layer_types`, every
  `full_attention_interval`-th layer is full attention.
- DeltaNet geometry: `linear_num_key_heads` (Hk), `linear_num_value_heads` (H, a multiple of
  Hk), `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`.
- full attention: q_proj doubled into q and a per-channel output gate, q/k norms, RoPE on
  `partial_rotary_factor` of each head (0.25 in the released models).
- every norm scales by (1 + w) in float32 and rounds once (the input, post-attention, q/k and
  final norms; not the DeltaNet's gated norm, whose weight is plain).
- MoE as Qwen3-MoE's (`num_experts`, `decoder_sparse_step`, `mlp_only_layers`,
  `norm_topk_prob`: engine/model_families.py) plus a shared expert of
  `shared_expert_intermediate_size` scaled by sigmoid(h · shared_expert_gate)
  (engine/model/qwen3_next/shared_expert_moe.py).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

CHUNK_SIZE = 64  # the prefill form's chunk (flash-linear-attention's and transformers')


@dataclass(frozen=True)
class DeltaNetDims:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float = 1e-6  # the gated RMSNorm's
    chunk_size: int = CHUNK_SIZE

    def __post_init__(self) -> None:
        assert self.num_value_heads % self.num_key_heads == 0, "value heads per key head"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The short convolution runs over q | k | v."""
        return 2 * self.key_dim + self.value_dim

    def per_rank(self, world_size: int) -> "DeltaNetDims":
        """One of `world_size` tensor-parallel ranks' mixer: its key heads and their value
        heads (engine/model/qwen3_next/sharded.py)."""
        return dataclasses.replace(
            self,
            num_key_heads=self.num_key_heads // world_size,
            num_value_heads=self.num_value_heads // world_size,
        )

    def check_tensor_parallel(self, size: int) -> str | None:
        """Why the mixer does not split over `size` ranks; None when it does."""
        if self.num_key_heads % size:
            return f"{size} does not divide the DeltaNet key heads ({self.num_key_heads})"
        return None

    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    def weight_elements(self) -> int:
        """A mixer's parameters (engine/model/qwen3_next/gated_deltanet.py): in_proj_qkvz,
        in_proj_ba, the conv, dt_bias and A_log, the gated norm, out_proj."""
        h, heads = self.hidden_size, self.num_value_heads
        projections = (2 * self.key_dim + 2 * self.value_dim + 2 * heads) * h
        return (
            projections
            + self.conv_dim * self.conv_kernel
            + 2 * heads
            + self.value_head_dim
            + (h * self.value_dim)
        )

    def recurrent_elements(self) -> int:
        """The delta rule's state: [value heads, key_head_dim, value_head_dim]."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim


def deltanet_dims(raw: dict[str, Any]) -> DeltaNetDims:
    """A qwen3_next config's gated DeltaNet geometry."""
    return DeltaNetDims(
        raw["hidden_size"],
        raw["linear_num_key_heads"],
        raw["linear_num_value_heads"],
        raw["linear_key_head_dim"],
        raw["linear_value_head_dim"],
        raw.get("linear_conv_kernel_dim", 4),
        raw.get("rms_norm_eps", 1e-6),
    )


def deltanet_layers(raw: dict[str, Any]) -> list[bool]:
    """Per layer: whether it is a gated DeltaNet layer (else gated full attention)."""
    num_layers = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if kinds:
        return [kind == "linear_attention" for kind in kinds[:num_layers]]
    interval = raw.get("full_attention_interval", 4)
    return [(i + 1) % interval != 0 for i in range(num_layers)]


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
