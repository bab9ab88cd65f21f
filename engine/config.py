"""Frozen configuration of the engine's parts, each checked once at construction."""

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.model_families import SUPPORTED_MODEL_TYPES, family_fields, rope_params
from schemas.errors import CheckpointError, ConfigError

# dtypes by name, with the bytes of one element: configuration and sizing need no torch (the
# worker turns a name into a torch.dtype, engine/memory.py)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(dtype: object) -> str:
    """The canonical name of a dtype given by name ("bf16") or as a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        choices = sorted([*DTYPE_BYTES, *DTYPE_ALIASES])
        raise ConfigError(f"dtype: unknown dtype {dtype!r}; choose one of {choices}")
    return name


def dtype_bytes(dtype: object) -> int:
    return DTYPE_BYTES[dtype_name(dtype)]


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

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise CheckpointError(f"hidden activation {self.hidden_act!r} is not supported")
        if self.partial_rotary_factor != 1.0:
            raise CheckpointError("partial_rotary_factor other than 1.0 is not supported")
        for name in ("layer_windows", "sparse_layers"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise CheckpointError(f"{name}: one entry per layer ({self.num_layers})")

    def window(self, layer_idx: int) -> int:
        """The layer's sliding window in tokens; 0: full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else 0

    def is_sparse(self, layer_idx: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer_idx]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
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
            attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
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
        return 2 * self.num_layers * num_kv_heads * self.head_dim * element

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads split across the ranks, or one replicated head each when ranks outnumber
        them (as vLLM does)."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def check_tensor_parallel(self, size: int) -> None:
        """Raise ConfigError unless the heads, KV heads and MLP split evenly over `size`."""
        heads = f"num_attention_heads {self.num_heads}, num_key_value_heads {self.num_kv_heads}"
        if self.num_heads % size:
            raise ConfigError(f"tensor_parallel_size: {size} does not divide {heads}")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size: {size} neither divides nor is a multiple of the KV "
                f"heads ({heads})"
            )
        for name in ("intermediate_size", "moe_intermediate_size"):
            if getattr(self, name) % size:
                raise ConfigError(
                    f"tensor_parallel_size: {size} does not divide {name} {getattr(self, name)}"
                )


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta`
    default = 1_000_000.0 if raw.get("model_type") == "gemma3_text" else 10000.0
    return float(rope_params(raw).get("rope_theta", raw.get("rope_theta", default)))


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = rope_params(raw) or raw.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    # Phi-3 keeps the pre-training length beside the scaling, not inside it
    original = raw.get("original_max_position_embeddings")
    return {"original_max_position_embeddings": original, **scaling} if original else scaling


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names: `method` "ngram" (prompt lookup) proposes up to
    `num_speculative_tokens` tokens a step from the longest suffix n-gram (`prompt_lookup_max`
    down to `prompt_lookup_min` tokens) found earlier in the sequence. Speculation steps aside
    for a step when more than `max_num_seqs_to_speculate` sequences run."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Measured on SmolLM2 (CPU, benchmarks/spec_decode.py) is left to the lead; 8 is cautious.
    max_num_seqs_to_speculate: int = 8

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ConfigError(
                f"speculative_config.method: {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)} (draft models are not built yet)"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config.num_speculative_tokens: must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64"
            )
        if self.max_num_seqs_to_speculate < 1:
            raise ConfigError("speculative_config.max_num_seqs_to_speculate: must be >= 1")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict of its fields, a JSON object, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: give an object of its fields")
        if value.get("method", "ngram") not in SPECULATIVE_METHODS:
            cls(method=str(value["method"]))  # raises, naming what is supported
        names = {spec.name for spec in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown fields {unknown}; known {sorted(names)}"
            )
        ints = [k for k, v in value.items() if k != "method" and type(v) is not int]
        if ints:
            raise ConfigError(f"speculative_config: {ints} must be integers")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({spec.name: getattr(self, spec.name) for spec in fields(self)})


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0
    # the device cache lives in host memory (a CPU executor): swapping a block out is a
    # memcpy, far cheaper than recomputing its tokens, so "auto" preemption swaps
    swap_is_cheap: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks: must be at least 1, got {self.num_blocks}")
        if self.num_cpu_blocks < 0:
            raise ConfigError("swap_space: must be >= 0")

    @property
    def num_slots(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"  # "auto" | "recompute" | "swap"
    max_waiting: int = 100_000
    vocab_size: int = 0  # the executor's; 0: token ids are not checked
    # a prefill chunk's most tokens a step (vLLM's); 0: the whole budget
    long_prefill_token_threshold: int = 0
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs: must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens: must be at least 1")
        if self.max_model_len < 2:
            raise ConfigError("max_model_len: must be at least 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens: must be >= max_model_len without chunked prefill"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold: must be >= 0 (0: off)")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError("preemption_mode: must be 'auto', 'recompute' or 'swap'")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_tensor_parallel(size: int, timeout_s: float) -> None:
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {size!r}")
    if timeout_s <= 0:
        raise ConfigError("tensor_parallel_timeout: must be positive")


@dataclass(frozen=True)
class ExecutorConfig:
    model_path: Path
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    gpu_memory_utilization: float = 0.9
    # bytes of host memory for swapped-out and evicted blocks; None: a quarter of the KV
    # cache's size on CPU (swapping there is a memcpy), none on CUDA
    swap_space: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 4096
    attention_backend: str = "auto"
    seed: int = 0
    # "auto": the model's dtype. "bfloat16" / "float16" halve a float32 model's K/V memory and
    # the bytes decode attention reads; compute stays in the model's dtype (cpu/torch backends)
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    # seconds any rank waits in a collective (a step, a keepalive) before the group fails
    tensor_parallel_timeout: float = 10.0
    # the proposer's n-gram sizes; also as JSON (how tensor-parallel ranks receive it)
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        _check_tensor_parallel(self.tensor_parallel_size, self.tensor_parallel_timeout)
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks: must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory: must be positive")
        if self.swap_space is not None and not 0 <= self.swap_space <= host_memory_bytes():
            raise ConfigError(
                f"swap_space: {self.swap_space} bytes is not in [0, host memory "
                f"{host_memory_bytes()}]"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization: must be in (0, 1]")


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, built once: from the offline `LLM`'s arguments, or from the
    services' Settings (same names). The executor's part is fixed when the model is known; the
    scheduler's when the executor has said what it holds (`ExecutorReady`)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's, at most 8192
    max_waiting: int = 100_000
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # vLLM's: 0 is off offline; `kvpager serve`: 512
    preemption_mode: str = "auto"
    seed: int = 0
    plan_ahead: int = 1  # steps planned beyond the one the executor runs (0: lockstep)
    tensor_parallel_size: int = 1  # ranks (processes, one device each) sharing the model
    tensor_parallel_timeout: float = 10.0
    # speculative decoding (None: off): a SpeculativeConfig, its fields as a dict, or JSON
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if self.plan_ahead < 0:
            raise ConfigError("plan_ahead: must be >= 0")
        # normalised once, here: every reader sees a SpeculativeConfig or None
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        _check_tensor_parallel(self.tensor_parallel_size, self.tensor_parallel_timeout)

    @classmethod
    def pick(cls, source: Any) -> "EngineConfig":
        """The fields `source` (e.g. the services' Settings) has under the same names."""
        names = [spec.name for spec in fields(cls) if hasattr(source, spec.name)]
        return cls(**{name: getattr(source, name) for name in names})

    def model_len(self, model_config: ModelConfig) -> int:
        """The configured limit, or the model's (at most 8192). Sliding windows do not cap it:
        every attention kernel masks each layer's window."""
        return self.max_model_len or min(model_config.max_position_embeddings, 8192)

    def executor_config(self, model_path: Path, model_config: ModelConfig) -> ExecutorConfig:
        names = {spec.name for spec in fields(ExecutorConfig)} & {
            spec.name for spec in fields(self)
        }
        values = {name: getattr(self, name) for name in names}
        values["max_model_len"] = self.model_len(model_config)
        model_config.check_tensor_parallel(self.tensor_parallel_size)
        return ExecutorConfig(model_path=model_path, **values)

    def scheduler_config(
        self, max_num_seqs: int, max_model_len: int, vocab_size: int = 0
    ) -> SchedulerConfig:
        """Limits for an executor that holds `max_num_seqs` rows of `max_model_len` tokens."""
        return SchedulerConfig(
            vocab_size=vocab_size,
            max_num_seqs=min(self.max_num_seqs, max_num_seqs),
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            max_waiting=self.max_waiting,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            speculative_config=self.speculative_config,
        )
