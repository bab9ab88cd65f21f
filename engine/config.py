"""Frozen configuration of the engine's parts, each checked once at construction."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.errors import CheckpointError, ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype: unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


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
    sliding_window: int | None = None  # the engine caps max_model_len to it

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")

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

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta`
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    return scaling


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")


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
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError("preemption_mode: must be 'auto', 'recompute' or 'swap'")
