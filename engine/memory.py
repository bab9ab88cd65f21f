"""Where a model and its KV cache go: the device, the dtypes, and how many blocks fit."""

import torch
from kvpager.engine.config import ExecutorConfig, host_memory_bytes
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.kv.state_pool import (
    PoolSplit,
    split_beside_blocks,
    split_host_pool,
    split_pool,
)
from kvpager.engine.model_config import ModelConfig, dtype_name
from kvpager.schemas.errors import ConfigError

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's
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
    config: ExecutorConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    extra_slots: int = 0,
) -> int:
    """Device KV blocks of a model without recurrent states (`device_pool`)."""
    return device_pool(config, model_config, kv_dtype, device, 0, extra_slots).num_blocks


def device_pool(
    config: ExecutorConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    slot_bytes: int,
    extra_slots: int = 0,
) -> PoolSplit:
    """Device KV blocks and state rows of `slot_bytes` each (engine/kv/state_pool.py):
    `num_blocks` with the states beside them, else split from what `kv_cache_memory` holds,
    else from what the `gpu_memory_utilization` share of the device (on CPU, of RAM) leaves
    after the weights."""
    per_block = kv_bytes_per_block(config, model_config, kv_dtype, extra_slots)
    if config.num_blocks is not None:
        return split_beside_blocks(config.num_blocks, per_block, slot_bytes, config.max_num_seqs)
    budget = _kv_budget(config, model_config, device)
    if budget is None:  # CPU default: never more than every sequence at full length needs
        groups = kv_groups(
            model_config.layer_windows, model_config.num_layers, model_config.cacheless_layers
        ).num_groups
        max_useful = groups * config.max_num_seqs * -(-config.max_model_len // config.block_size)
        return split_pool(
            DEFAULT_CPU_KV_CACHE_BYTES, per_block, slot_bytes, config.max_num_seqs, max_useful
        )
    if budget < per_block + slot_bytes:
        name = "kv_cache_memory" if config.kv_cache_memory is not None else "gpu_memory_utilization"
        raise ConfigError(
            f"{name}: {max(budget, 0)} bytes are left for the KV cache, not one {per_block}-byte "
            f"block" + (f" and one {slot_bytes}-byte state slot" if slot_bytes else "")
            + "; raise it, or give --kv-cache-memory / --num-blocks"
        )  # fmt: skip
    return split_pool(budget, per_block, slot_bytes, config.max_num_seqs)


def _kv_budget(
    config: ExecutorConfig, model_config: ModelConfig, device: torch.device
) -> int | None:
    """Bytes for the KV cache; None: the CPU default. vLLM's meaning of the utilization: the
    share of the whole memory that weights plus KV cache may take."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    utilization = config.gpu_memory_utilization
    if device.type == "cuda":  # the weights are loaded by now: in use = total - free
        free, total = torch.cuda.mem_get_info(device)
        return int(free - (1 - (utilization or DEFAULT_GPU_MEMORY_UTILIZATION)) * total)
    if utilization is None:
        return None
    weight_dtype = resolve_dtype(config.dtype, model_config, device)
    weights = weight_bytes_per_rank(model_config, weight_dtype, config.tensor_parallel_size)
    return int(utilization * host_memory_bytes()) - weights


def host_pool(
    config: ExecutorConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    device_split: PoolSplit,
    extra_slots: int = 0,
) -> PoolSplit:
    """Host blocks for swapped-out and evicted blocks, and host rows of the states carved from
    the same bytes (engine/kv/state_pool.py): `swap_space` bytes, else a quarter of the device
    cache's blocks on a CPU device (swapping there is a memcpy) and none on CUDA."""
    per_block = kv_bytes_per_block(config, model_config, kv_dtype, extra_slots)
    swap_bytes = config.swap_space
    if swap_bytes is None:
        swap_bytes = device_split.num_blocks // CPU_SWAP_FRACTION * per_block
        swap_bytes = swap_bytes if device.type == "cpu" else 0
    return split_host_pool(
        swap_bytes, per_block, device_split.slot_bytes, device_split.num_slots,
        bool(config.kv_disk_dir),
    )  # fmt: skip


def kv_bytes_per_block(
    config: ExecutorConfig, model_config: ModelConfig, kv_dtype: torch.dtype, extra_slots: int = 0
) -> int:
    """One block on one rank (its share of the KV heads): every layer's K/V, or with several
    KV groups (engine/kv/kv_groups.py) a group's layers, plus `extra_slots` layers of the same
    shape (a draft model's, engine/worker/spec_decode/draft_model.py)."""
    per_token = model_config.kv_bytes_per_token(kv_dtype, config.tensor_parallel_size)
    groups = kv_groups(
        model_config.layer_windows, model_config.num_layers, model_config.cacheless_layers
    )
    num_slots = groups.num_slots + extra_slots
    return per_token // model_config.num_kv_layers * num_slots * config.block_size
