"""A checkpoint's architecture as the decoder needs it (ModelConfig, read from config.json),
and dtypes by name: everything the engine knows of a model before any weight is loaded.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpager.engine.deepseek_family import deepseek_config
from kvpager.engine.families.nemotron_h import NEMOTRON_H, nemotron_config
from kvpager.engine.families.qwen3_5 import QWEN3_5_TYPES, qwen3_5_text_config
from kvpager.engine.families.qwen3_next import DeltaNetDims
from kvpager.engine.llama4_family import LLAMA4_TEXT, llama4_text_config
from kvpager.engine.mamba2_config import Mamba2Dims, granite_config
from kvpager.engine.model_families import SUPPORTED_MODEL_TYPES, family_fields, rope_params
from kvpager.schemas.errors import CheckpointError, ConfigError

# dtypes by name, with the bytes of one element: configuration and sizing need no torch (the
# worker turns a name into a torch.dtype, engine/memory.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# dtypes of a KV cache only (vLLM's names; "fp8" is e4m3): one byte an element, with per-layer
# scales (engine/model/kv_scales.py)
FP8_BYTES = {"float8_e4m3fn": 1, "float8_e5m2": 1}
FP8_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = ("auto", *FP8_ALIASES, *DTYPE_BYTES)


def dtype_name(dtype: object) -> str:
    """The canonical name of a dtype given by name ("bf16") or as a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        choices = sorted([*DTYPE_BYTES, *DTYPE_ALIASES])
        raise ConfigError(f"dtype: unknown dtype {dtype!r}; choose one of {choices}")
    return name


def dtype_bytes(dtype: object) -> int:
    """Bytes of one element of a model dtype or of an fp8 KV cache dtype."""
    name = str(dtype).removeprefix("torch.")
    name = FP8_ALIASES.get(name, name)
    return FP8_BYTES[name] if name in FP8_BYTES else DTYPE_BYTES[dtype_name(dtype)]


def check_kv_cache_dtype(name: str) -> None:
    """ConfigError naming the accepted values unless `name` is "auto" or a KV cache dtype."""
    if name != "auto":
        kv_cache_dtype_name(name)


def kv_cache_dtype_name(name: object) -> str:
    """The canonical dtype of a `kv_cache_dtype` other than "auto": an fp8 name (fp8 = fp8_e4m3
    -> float8_e4m3fn, fp8_e5m2 -> float8_e5m2) or a model dtype ("bf16"); ConfigError else."""
    text = str(name).removeprefix("torch.")
    text = FP8_ALIASES.get(text, text)
    if text in FP8_BYTES:
        return text
    try:
        return dtype_name(text)
    except ConfigError:
        choices = [*KV_CACHE_DTYPES, *DTYPE_ALIASES]
        raise ConfigError(
            f"kv_cache_dtype: unknown dtype {name!r}; choose one of {choices}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields the decoder needs, read from a checkpoint's config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the window of the sliding layers (layer_windows)
    # the per-family switches (engine/model_families.py); the defaults are Llama's
    hidden_act: str = "silu"
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    gemma_norms: bool = False  # (1 + w) norms, sandwich norms, embeddings * sqrt(hidden)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this), not head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, where it differs
    partial_rotary_factor: float = 1.0
    sparse_layers: tuple[bool, ...] = ()  # per layer: routed experts instead of one MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # gpt-oss (engine/model_families.py: _gpt_oss_fields; engine/model/gpt_oss.py)
    attention_sinks: bool = False  # a learned logit per head joins every softmax
    o_proj_bias: bool = False
    float32_norms: bool = False  # norm weights kept in float32 (Gemma's are, by gemma_norms)
    gpt_oss_experts: bool = False  # router bias, softmax over the top k, biased clamped SwiGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Llama 4 (engine/llama4_family.py)
    nope_layers: tuple[bool, ...] = ()  # per layer: no RoPE (a NoPE layer)
    rope_interleaved: bool = False  # RoPE on adjacent pairs: q / k rows reordered at load
    qk_l2_norm: bool = False  # a weightless RMSNorm of q and k after RoPE, RoPE layers only
    attn_temperature: tuple[float, float] | None = None  # NoPE layers' (floor_scale, attn_scale)
    shared_expert_intermediate_size: int = 0  # a dense MLP beside a MoE layer's experts
    moe_router: str = "softmax"  # "llama4": sigmoid top-k scores scale the experts' inputs
    # DeepSeek V3 (engine/deepseek_family.py): latent attention where kv_lora_rank > 0
    kv_lora_rank: int = 0  # the per-token latent the cache holds (beside the rotary key)
    q_lora_rank: int = 0  # 0: one q_proj
    qk_nope_head_dim: int = 0  # each head's q / k part without RoPE (head_dim: the RoPE part)
    v_head_dim: int = 0
    expert_groups: tuple[int, int] = (1, 1)  # (n_group, topk_group) of the "deepseek" router
    routed_scaling_factor: float = 1.0
    # recurrent hybrids (engine/mamba2_config.py): Mamba2 layers on per-sequence state slots
    recurrent_layers: tuple[bool, ...] = ()  # per layer: a Mamba2 mixer instead of attention
    recurrent_mixer: str = ""  # the recurrent layers' kind (engine/model/recurrent.py: MIXERS)
    mamba_dims: Mamba2Dims | None = None
    mamba_proj_bias: bool = False
    mamba_conv_bias: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # each branch's output, before its residual add
    logits_scaling: float = 1.0  # the logits divided by it
    attention_multiplier: float | None = None  # the attention scale, where it is not 1/sqrt(d)
    # Qwen3-Next (engine/families/qwen3_next.py): gated DeltaNet mixers, gated attention
    deltanet_dims: DeltaNetDims | None = None
    attn_output_gate: bool = False  # q_proj doubled: q and a sigmoid gate on the output
    zero_centred_norms: bool = False  # (1 + w) norms in float32, without Gemma's extras
    shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(h . gate)
    # Nemotron-H (engine/families/nemotron_h.py): one residual block a layer
    layer_blocks: tuple[str, ...] = ()  # per layer: "mixer" or "mlp" only; () both, as others
    gated_mlp: bool = True  # False: up -> activation -> down (relu2), no gate rows

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh", "gelu", "relu2"):
            raise CheckpointError(f"hidden activation {self.hidden_act!r} is not supported")
        if self.partial_rotary_factor != 1.0 and not self.attn_output_gate:
            raise CheckpointError("partial_rotary_factor other than 1.0 is not supported")
        if self.mla and (self.kv_lora_rank + self.head_dim) % 2:
            raise CheckpointError("kv_lora_rank + qk_rope_head_dim must be even (latent pages)")
        if self.cacheless_layers and all(self.cacheless_layers):
            raise CheckpointError("recurrent hybrids: at least one attention layer is needed")
        if self.hidden_act == "relu2" and self.gated_mlp:
            raise CheckpointError("relu2 goes with ungated MLPs (Nemotron-H) alone")
        names = ("layer_windows", "sparse_layers", "nope_layers", "recurrent_layers")
        for name in (*names, "layer_blocks"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise CheckpointError(f"{name}: one entry per layer ({self.num_layers})")

    def window(self, layer_idx: int) -> int:
        """The layer's sliding window in tokens; 0: full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else 0

    def uses_rope(self, layer_idx: int) -> bool:
        return not (self.nope_layers and self.nope_layers[layer_idx])

    def is_recurrent(self, layer_idx: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer_idx]

    @property
    def num_recurrent_layers(self) -> int:
        return sum(self.recurrent_layers)

    def has_mixer(self, layer_idx: int) -> bool:
        """Whether the layer has its first block (attention or a recurrent mixer)."""
        return not self.layer_blocks or self.layer_blocks[layer_idx] != "mlp"

    def has_mlp(self, layer_idx: int) -> bool:
        """Whether the layer has its second block (an MLP or routed experts)."""
        return not self.layer_blocks or self.layer_blocks[layer_idx] != "mixer"

    @property
    def cacheless_layers(self) -> tuple[bool, ...]:
        """Per layer: no K/V in the paged cache (a recurrent mixer, or no first block);
        () where every layer attends. What engine/kv/kv_groups.py leaves out."""
        if not self.layer_blocks:
            return self.recurrent_layers
        return tuple(self.is_recurrent(i) or not self.has_mixer(i) for i in range(self.num_layers))

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the paged cache holds (recurrent layers hold state slots)."""
        return self.num_layers - sum(self.cacheless_layers)

    def is_sparse(self, layer_idx: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer_idx]

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): a latent per token, not K / V per head."""
        return self.kv_lora_rank > 0

    @property
    def cache_head_dim(self) -> int:
        """The cache's last dim. MLA's row, the latent and the rotary key, is split in two
        halves over the cache's K and V planes (one head each): a token holds that row once."""
        return (self.kv_lora_rank + self.head_dim) // 2 if self.mla else self.head_dim

    @property
    def attention_scale(self) -> float:
        if self.mla:  # qk_head_dim^-0.5, times YaRN's mscale(mscale_all_dim)^2 (transformers')
            scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
            scaling = self.rope_scaling or {}
            if scaling.get("mscale_all_dim"):
                mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
                scale = scale * (mscale * mscale if scaling["factor"] > 1 else 1.0)
            return scale
        if self.attention_multiplier is not None:  # Granite's
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        raw = granite_config(
            deepseek_config(llama4_text_config(nemotron_config(qwen3_5_text_config(raw))))
        )
        model_type = raw.get("model_type", "")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            # Llama 4's dense layers are intermediate_size_mlp wide (its experts the other)
            intermediate_size=raw.get("intermediate_size_mlp") or raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Llama/Mistral say so with attention_bias.
            attention_bias=model_type == "qwen2"
            or raw.get("attention_bias", model_type == "gpt_oss"),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(raw),
            **family_fields(raw),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise CheckpointError(f"{path}: no config.json; is this a checkpoint folder?")
        try:
            raw = json.loads(config_file.read_text())
            return cls.from_dict(raw)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{config_file}: unreadable model config ({exc!r})") from exc

    def kv_bytes_per_token(self, dtype: object, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V for one token across all layers (on one rank of a group); `dtype`
        by name or as a torch.dtype."""
        element = dtype_bytes(dtype)
        num_kv_heads = self.kv_heads_per_rank(tensor_parallel_size)
        return 2 * self.num_kv_layers * num_kv_heads * self.cache_head_dim * element

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads split across the ranks, or one replicated head each when ranks outnumber
        them (as vLLM does)."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def check_tensor_parallel(self, size: int) -> None:
        """Raise ConfigError unless the heads, KV heads and MLP split evenly over `size`."""
        heads = f"num_attention_heads {self.num_heads}, num_key_value_heads {self.num_kv_heads}"
        # Qwen3.5's flat DeltaNet names and Nemotron-H's have no per-rank spans yet
        one_rank = (LLAMA4_TEXT, NEMOTRON_H, *QWEN3_5_TYPES)
        if size > 1 and self.model_type in one_rank:
            raise ConfigError(f"tensor_parallel_size: {self.model_type} is served on one rank only")
        # recurrent mixers split by heads (engine/model/sharding.py: Mamba2Shard; Qwen3-Next's
        # DeltaNet: engine/model/qwen3_next/sharded.py)
        for dims in (self.mamba_dims, self.deltanet_dims):
            why = dims.check_tensor_parallel(size) if dims is not None else None
            if why is not None:
                raise ConfigError(f"tensor_parallel_size: {why}")
        if self.num_heads % size:
            raise ConfigError(f"tensor_parallel_size: {size} does not divide {heads}")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size: {size} neither divides nor is a multiple of the KV "
                f"heads ({heads})"
            )
        shared = "shared_expert_intermediate_size"  # DeepSeek's shared experts split too
        for name in ("intermediate_size", "moe_intermediate_size", shared):
            if getattr(self, name) % size:
                raise ConfigError(
                    f"tensor_parallel_size: {size} does not divide {name} {getattr(self, name)}"
                )


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta`
    defaults = {"gemma3_text": 1_000_000.0, "gpt_oss": 150000.0}  # their configs' defaults
    default = defaults.get(raw.get("model_type", ""), 10000.0)
    return float(rope_params(raw).get("rope_theta", raw.get("rope_theta", default)))


# GptOssConfig's RoPE where config.json gives none (`rope_scaling` null, no rope_parameters)
GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = rope_params(raw) or raw.get("rope_scaling")
    if not scaling and raw.get("model_type") == "gpt_oss":
        scaling = GPT_OSS_DEFAULT_ROPE
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    # Phi-3 keeps the pre-training length beside the scaling, not inside it
    original = raw.get("original_max_position_embeddings")
    return {"original_max_position_embeddings": original, **scaling} if original else scaling


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")
