"""Settings shared by every engine in one benchmark run, so peers get the same limits."""

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class BenchConfig:
    model_path: Path
    dtype: str = "float32"
    num_threads: int = 2
    block_size: int = 16
    kv_cache_gib: float = 2.0  # KV budget of every paged engine (kvpager, vLLM, transformers CB)
    kv_cache_dtype: str = "auto"  # kvpager's only: "bfloat16" halves a float32 model's K/V
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    hf_batch_size: int = 16  # static batches of transformers `generate`
    vllm_python: Path = Path("/tmp/vllm-venv/bin/python")

    def __post_init__(self) -> None:
        assert self.dtype in ("float32", "bfloat16"), f"unsupported dtype {self.dtype}"
        assert self.num_threads >= 1 and self.hf_batch_size >= 1

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * 1024**3)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


def kv_bytes_per_token(model_path: Path, dtype: torch.dtype) -> int:
    """K and V bytes of one token over all layers, from the checkpoint's config."""
    from kvpager.engine.model_config import ModelConfig

    return ModelConfig.from_path(model_path).kv_bytes_per_token(dtype)
