"""Gated DeltaNet layer geometry (Qwen3-Next's `linear_attention` layers) read from
config.json, without torch: the scheduler's side sizes states with it
(engine/kv/recurrent_size.py), the model builds its mixers with it
(engine/model/gated_deltanet.py).

`qwen3_next`: `linear_num_key_heads` (Hk), `linear_num_value_heads` (H, a multiple of Hk),
`linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`; the DeltaNet layers
are those `layer_types` names "linear_attention", or without it every layer but each
`full_attention_interval`-th.
"""

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

    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

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
