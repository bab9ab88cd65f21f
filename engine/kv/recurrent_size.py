"""Sizes of hybrid recurrent models' caches, read from config.json: the per-sequence state of
their recurrent layers and the per-token K/V of their attention layers.

A recurrent layer's state does not grow with the sequence (engine/kv/state_slots.py):
- Mamba2 (`granitemoehybrid`, `nemotron_h`): a conv state [conv_dim, d_conv - 1], conv_dim =
  heads * head_dim + 2 * n_groups * d_state, and an SSM state [heads, head_dim, d_state];
- gated DeltaNet (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`, and multimodal `qwen3_5` /
  `qwen3_5_moe` by their text_config): a conv state [2 * k_heads * k_dim + v_heads * v_dim,
  kernel - 1] and a recurrent state [v_heads, k_dim, v_dim].
The conv state is held in the model's dtype (also beside an fp8 KV cache), the SSM /
recurrent state in float32, as engine/model/mamba2.py holds them (the scan accumulates in
float32). The states come out of the KV budget (engine/kv/state_pool.py): kv-size prints the
split the executor makes of a budget.

`kvpager kv-size` uses this for these model types (each served end to end:
docs/user/models.md); sizing them is what plans a deployment. With --tensor-parallel-size, the
sizes are one rank's (its heads' state, its KV heads).
"""

from dataclasses import dataclass
from typing import Any

from kvpager.engine.families.nemotron_h import layer_pattern, nemotron_config
from kvpager.engine.families.qwen3_5 import MULTIMODAL_TYPES, QWEN3_5_TYPES, qwen3_5_text_config
from kvpager.engine.families.qwen3_next import deltanet_dims, deltanet_layers
from kvpager.engine.kv.state_pool import split_pool
from kvpager.engine.mamba2_config import mamba2_dims, mamba_layers
from kvpager.engine.model_config import dtype_bytes
from kvpager.schemas.errors import ConfigError

DELTANET_MODEL_TYPES = ("qwen3_next", *QWEN3_5_TYPES, *MULTIMODAL_TYPES)
RECURRENT_MODEL_TYPES = ("granitemoehybrid", "nemotron_h", *DELTANET_MODEL_TYPES)


@dataclass(frozen=True)
class HybridSize:
    model_type: str
    num_recurrent_layers: int
    num_attention_layers: int
    conv_elements: int  # per sequence, all recurrent layers
    ssm_elements: int  # per sequence, all recurrent layers
    kv_elements_per_token: int  # K and V, all attention layers
    tensor_parallel_size: int = 1  # the sizes are one rank's (its heads') of this many

    def state_bytes(self, dtype: object) -> int:
        """One sequence's recurrent state: conv in `dtype` (the model's), SSM in float32."""
        return self.conv_elements * dtype_bytes(dtype) + self.ssm_elements * 4

    def kv_bytes_per_token(self, dtype: object) -> int:
        return self.kv_elements_per_token * dtype_bytes(dtype)

    def lines(
        self,
        dtype: object,
        tokens: int,
        budget_bytes: int,
        state_dtype: object = None,
        users: int = 256,
        block_size: int = 16,
    ) -> list[str]:
        """The sizes, and how the executor splits `budget_bytes` between KV blocks of
        `block_size` tokens in `dtype` and state rows in `state_dtype` (the model's; None:
        `dtype`) for `users` sequences at most (engine/kv/state_pool.py)."""
        state_dtype = state_dtype or dtype
        state, per_token = self.state_bytes(state_dtype), self.kv_bytes_per_token(dtype)
        per_seq = state + per_token * tokens
        mib, gib = 1024**2, 1024**3
        ranks = self.tensor_parallel_size
        split = split_pool(budget_bytes, per_token * block_size, state, users)
        name = str(dtype).removeprefix("torch.")
        return [
            f"{self.model_type}: {self.num_recurrent_layers} recurrent layers, "
            f"{self.num_attention_layers} attention layers"
            + (f"; bytes below are per rank of {ranks} (its heads)" if ranks > 1 else ""),
            f"state bytes per sequence:  {state:,} ({state / mib:.2f} MiB; conv in "
            f"{str(state_dtype).removeprefix('torch.')}, SSM in float32; any length)",
            f"KV bytes per token:        {per_token:,} (attention layers only; KV in {name})",
            f"bytes per sequence:        {per_seq:,} ({per_seq / gib:.3f} GiB at {tokens} tokens)",
            f"sequences that fit:        {budget_bytes // per_seq if per_seq else 0} "
            f"in {budget_bytes / gib:.2f} GiB",
            f"the budget's split (max_num_seqs {users}, block size {block_size}), states first:",
            *split.lines(),
        ]


def hybrid_size(raw: dict[str, Any], tensor_parallel_size: int = 1) -> HybridSize | None:
    """The sizes of a recurrent hybrid's config.json (one of `tensor_parallel_size` ranks'
    share: engine/model/sharding.py, Mamba2Shard); None for other model types."""
    model_type, size = raw.get("model_type", ""), tensor_parallel_size
    if model_type in ("granitemoehybrid", "nemotron_h"):
        dims, layers = mamba2_dims(nemotron_config(raw)), mamba_layers(raw)
        if (why := dims.check_tensor_parallel(size)) is not None:
            raise ConfigError(f"tensor_parallel_size: {why}")
        dims = dims.per_rank(size)
        recurrent = sum(layers)
        attention = (
            layer_pattern(raw).count("*") if model_type == "nemotron_h" else len(layers) - recurrent
        )
        return HybridSize(
            model_type,
            recurrent,
            attention,
            recurrent * dims.conv_dim * (dims.conv_kernel - 1),
            recurrent * dims.num_heads * dims.head_dim * dims.state_size,
            attention * _kv_per_layer(raw, size),
            size,
        )
    if model_type in DELTANET_MODEL_TYPES:
        return _deltanet(qwen3_5_text_config(raw), size)
    return None


def _deltanet(raw: dict[str, Any], size: int) -> HybridSize:
    dims, layers = deltanet_dims(raw), deltanet_layers(raw)
    if (why := dims.check_tensor_parallel(size)) is not None:
        raise ConfigError(f"tensor_parallel_size: {why}")
    dims = dims.per_rank(size)
    recurrent = sum(layers)
    attention = len(layers) - recurrent
    return HybridSize(
        raw["model_type"],
        recurrent,
        attention,
        recurrent * dims.conv_elements(),
        recurrent * dims.recurrent_elements(),
        attention * _kv_per_layer(raw, size),
        size,
    )


def _kv_per_layer(raw: dict[str, Any], size: int = 1) -> int:
    """K and V of one attention layer on one of `size` ranks (KV heads replicated past their
    count, as ModelConfig.kv_heads_per_rank)."""
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    return 2 * max(1, raw.get("num_key_value_heads", heads) // size) * head_dim
