"""The executor's cache tensors: the KV dtype, the device cache sized to what fits and the CPU
pool's twin for swapped blocks. The block count is the smallest rank's in a tensor-parallel
group, so every rank takes the same block ids.
"""

import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.kv_groups import KvGroups
from kvpager.engine.memory import blocks_that_fit, cpu_blocks_that_fit
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig, kv_cache_dtype_name
from kvpager.engine.parallel.group import TensorParallel
from kvpager.schemas.errors import ConfigError


def kv_cache_dtype(config: ExecutorConfig, dtype: torch.dtype, backend: str) -> torch.dtype:
    """The cache's dtype: the model's unless `kv_cache_dtype` names another the backend takes."""
    if config.kv_cache_dtype == "auto":
        return dtype
    kv_dtype = getattr(torch, kv_cache_dtype_name(config.kv_cache_dtype))
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)  # every backend takes fp8
    if kv_dtype != dtype and not fp8 and backend == "triton":
        raise ConfigError(
            "kv_cache_dtype: a cache dtype other than the model's or fp8 runs on the cpu "
            "and torch attention backends only"
        )
    return kv_dtype


def allocate_kv_caches(
    config: ExecutorConfig,
    model_config: ModelConfig,
    shard: Shard,
    kv_groups: KvGroups,
    kv_dtype: torch.dtype,
    device: torch.device,
    group: TensorParallel | None,
    extra_slots: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device KV cache, sized to what fits, and the CPU pool for swapped blocks;
    `extra_slots` more layer slots a block for a draft model's K/V (after the target's)."""
    num_blocks = blocks_that_fit(config, model_config, kv_dtype, device, extra_slots)
    if group is not None:  # the same block ids everywhere: the smallest rank's cache
        num_blocks = group.smallest(num_blocks)
    # [slots, K/V, blocks, block_size, kv_heads, head_dim]: a slot per layer, or per
    # layer of a KV group when there are several (engine/kv/kv_groups.py)
    kv_cache = torch.zeros(
        (
            kv_groups.num_slots + extra_slots,
            2,
            num_blocks,
            config.block_size,
            shard.num_kv_heads,
            model_config.cache_head_dim,  # MLA: half its latent row (model_config.py)
        ),
        dtype=kv_dtype,
        device=device,
    )
    num_cpu_blocks = cpu_blocks_that_fit(
        config, model_config, kv_dtype, device, num_blocks, extra_slots
    )
    if group is not None:
        num_cpu_blocks = group.smallest(num_cpu_blocks)
    pin = device.type == "cuda"
    cpu_shape = list(kv_cache.shape)
    cpu_shape[2] = num_cpu_blocks
    # [slots, K/V, cpu_blocks, block_size, kv_heads, head_dim], pinned for async copies
    cpu_cache = torch.zeros(cpu_shape, dtype=kv_dtype, pin_memory=pin)
    return kv_cache, cpu_cache
