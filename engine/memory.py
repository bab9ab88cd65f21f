"""Where a model and its KV cache go: the device, the dtypes, and how many blocks fit."""

import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.model_config import ModelConfig, dtype_name
from kvpager.schemas.errors import ConfigError

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
CPU_SWAP_FRACTION = 4  # default CPU swap pool on a CPU device: a quarter of the KV cache


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when there is a device, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype by name ("bf16", "float32") or as itself; unknown names are a ConfigError."""
    return getattr(torch, dtype_name(name))


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype, except that on a CPU float16 runs in float32, and so
    does bfloat16 without native bf16 matmuls (AVX-512-BF16 / AMX): there bf16 runs several
    times slower than float32."""
    if name != "auto":
        return torch_dtype(name)
    dtype = torch_dtype(model_config.checkpoint_dtype)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return torch.float32
    return dtype


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def blocks_that_fit(
    config: ExecutorConfig, model_config: ModelConfig, kv_dtype: torch.dtype, device: torch.device
) -> int:
    """Device KV blocks: `num_blocks`, else what `kv_cache_memory` (or free GPU memory) holds."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = kv_bytes_per_block(config, model_config, kv_dtype)
    budget = config.kv_cache_memory
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - config.gpu_memory_utilization) * total)
    if budget is None:  # CPU default: never more than every sequence at full length needs
        groups = kv_groups(model_config.layer_windows, model_config.num_layers).num_groups
        max_useful = groups * config.max_num_seqs * -(-config.max_model_len // config.block_size)
        return max(1, min(DEFAULT_CPU_KV_CACHE_BYTES // per_block, max_useful))
    if budget < per_block:
        raise ConfigError(f"kv_cache_memory: {budget} bytes hold no {per_block}-byte block")
    return budget // per_block


def cpu_blocks_that_fit(
    config: ExecutorConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
) -> int:
    """Host blocks for swapped-out and evicted blocks: `swap_space` bytes, else a quarter of
    the device cache on a CPU device (swapping there is a memcpy) and none on CUDA."""
    per_block = kv_bytes_per_block(config, model_config, kv_dtype)
    if config.swap_space is None:
        return num_blocks // CPU_SWAP_FRACTION if device.type == "cpu" else 0
    return config.swap_space // per_block


def kv_bytes_per_block(
    config: ExecutorConfig, model_config: ModelConfig, kv_dtype: torch.dtype
) -> int:
    """One block on one rank (its share of the KV heads): every layer's K/V, or with several
    KV groups (engine/kv/kv_groups.py) a group's layers."""
    per_token = model_config.kv_bytes_per_token(kv_dtype, config.tensor_parallel_size)
    groups = kv_groups(model_config.layer_windows, model_config.num_layers)
    return per_token // model_config.num_layers * groups.num_slots * config.block_size
