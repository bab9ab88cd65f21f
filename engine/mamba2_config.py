"""Mamba2 layer geometry read from config.json, without torch: the scheduler's side sizes
states with it (engine/kv/recurrent_size.py), the model builds its mixers with it
(engine/model/mamba2.py). Below them, the granitemoehybrid family's decoder switches.

- `granitemoehybrid`: `mamba_n_heads`, `mamba_d_head` ("auto": mamba_expand * hidden /
  heads), `mamba_n_groups`, `mamba_d_state`, `mamba_d_conv`, `mamba_chunk_size`; the Mamba
  layers are those `layer_types` (or the older `layers_block_type`) names "mamba", or
  "linear_attention" as transformers 5 writes them back.
- `nemotron_h`: `mamba_num_heads`, `mamba_head_dim`, `n_groups`, `ssm_state_size`,
  `conv_kernel`, `chunk_size`; the Mamba layers are the "M"s of `hybrid_override_pattern`
  ("*" attention, "-" MLP, "E" MoE), or transformers 5's `layers_block_type` "linear_attention"
  (the family's switches: engine/families/nemotron_h.py).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int  # mamba_n_heads
    head_dim: int  # mamba_d_head
    num_groups: int  # mamba_n_groups: B and C are shared by num_heads / num_groups heads
    state_size: int  # mamba_d_state
    conv_kernel: int  # mamba_d_conv
    chunk_size: int  # mamba_chunk_size: the prefill scan's chunk
    eps: float = 1e-6
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def per_rank(self, world_size: int) -> "Mamba2Dims":
        """One of `world_size` tensor-parallel ranks' mixer: its share of the heads and of the
        groups, or the one group its heads read when the ranks outnumber the groups (each
        group then replicated on world_size / num_groups ranks, as vLLM's MambaMixer2 does).
        check_tensor_parallel (below) said first that they split."""
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // world_size,
            num_groups=max(1, self.num_groups // world_size),
        )

    def first_group(self, rank: int, world_size: int) -> int:
        """The first of the model's groups rank `rank`'s heads read."""
        return rank * self.num_groups // world_size

    def check_tensor_parallel(self, size: int) -> str | None:
        """Why the mixer does not split over `size` ranks; None when it does."""
        if self.num_heads % size:
            return f"{size} does not divide the Mamba heads (mamba_n_heads {self.num_heads})"
        if self.num_groups % size and size % self.num_groups:
            return (
                f"{size} neither divides nor is a multiple of the Mamba groups "
                f"(mamba_n_groups {self.num_groups})"
            )
        return None

    def state_elements(self) -> int:
        """Elements of one sequence's state in one layer: conv plus SSM."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        return conv + self.num_heads * self.head_dim * self.state_size


def mamba2_dims(raw: dict[str, Any]) -> Mamba2Dims:
    """A granitemoehybrid or nemotron_h config's Mamba2 geometry."""
    limit = tuple(raw.get("time_step_limit") or (0.0, float("inf")))
    if raw.get("model_type") == "nemotron_h":
        return Mamba2Dims(
            raw["hidden_size"],
            raw["mamba_num_heads"],
            raw["mamba_head_dim"],
            raw.get("n_groups", 8),
            raw.get("ssm_state_size", 128),
            raw.get("conv_kernel", 4),
            raw.get("chunk_size", 128),
            raw.get("layer_norm_epsilon", 1e-5),
            limit,
        )
    heads = raw.get("mamba_n_heads", 128)
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = raw.get("mamba_expand", 2) * raw["hidden_size"] // heads
    return Mamba2Dims(
        raw["hidden_size"],
        heads,
        head_dim,
        raw.get("mamba_n_groups", 1),
        raw.get("mamba_d_state", 256),
        raw.get("mamba_d_conv", 4),
        raw.get("mamba_chunk_size", 256),
        raw.get("rms_norm_eps", 1e-6),
        limit,
    )


def mamba_layers(raw: dict[str, Any]) -> list[bool]:
    """Per layer: whether it is a Mamba2 layer (transformers 5 writes nemotron_h's pattern as
    `layers_block_type`, "linear_attention" for "M")."""
    if raw.get("model_type") == "nemotron_h" and raw.get("hybrid_override_pattern"):
        return [kind == "M" for kind in raw["hybrid_override_pattern"]]
    kinds = raw.get("layer_types") or raw.get("layers_block_type")
    kinds = kinds or ["mamba"] * raw["num_hidden_layers"]
    return [kind in ("mamba", "linear_attention") for kind in kinds]


# --- Granite 4 hybrids (`granitemoehybrid`) as decoder switches, read as transformers'
# GraniteMoeHybridConfig reads them:
#
# - `layer_types` (or the older `layers_block_type`): "mamba" / "linear_attention" layers run a
#   Mamba2 mixer on per-sequence state slots (engine/model/mamba2.py), the others attention on
#   the paged cache; `position_embedding_type` "rope", or anything else for no rotary at all;
# - every layer's MLP is a shared MLP (`shared_intermediate_size`), beside routed experts
#   (`num_local_experts` of `intermediate_size`, softmax over the top-k logits) where there are
#   any;
# - `embedding_multiplier` scales the embeddings, `residual_multiplier` each branch before its
#   residual add, `attention_multiplier` is the attention scale and the logits are divided by
#   `logits_scaling`.

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
    # missing fields read as GraniteMoeHybridConfig's defaults: 8 experts, no RoPE
    num_experts = raw.get("num_local_experts", 8) or 0
    shared = raw.get("shared_intermediate_size", 1024)
    rope = raw.get("position_embedding_type") == "rope"
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
        moe_intermediate_size=raw.get("intermediate_size", 11008),
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
