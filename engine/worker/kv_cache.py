"""The executor's cache tensors: the KV dtype, the device cache sized to what fits and the CPU
pool's twin for swapped blocks. The block count is the smallest rank's in a tensor-parallel
group, so every rank takes the same block ids.
"""

import dataclasses

import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.kv_groups import KvGroups
from kvpager.engine.kv.state_pool import PoolSplit
from kvpager.engine.memory import device_pool, host_pool
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
    slot_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, PoolSplit, PoolSplit]:
    """The device KV cache, sized to what fits beside `slot_bytes`-byte recurrent state rows
    (engine/kv/state_pool.py), and the CPU pool for swapped blocks; `extra_slots` more layer
    slots a block for a draft model's K/V (after the target's). Also how each pool's bytes
    were split between blocks and state rows (the state rows are make_state_cache's)."""
    split = _same_on_every_rank(
        device_pool(config, model_config, kv_dtype, device, slot_bytes, extra_slots), group
    )
    # [slots, K/V, blocks, block_size, kv_heads, head_dim]: a slot per layer, or per
    # layer of a KV group when there are several (engine/kv/kv_groups.py)
    shape = [
        kv_groups.num_slots + extra_slots,
        2,
        split.num_blocks,
        config.block_size,
        shard.num_kv_heads,
        model_config.cache_head_dim,  # MLA: half its latent row (model_config.py)
    ]
    kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
    host = _same_on_every_rank(
        host_pool(config, model_config, kv_dtype, device, split, extra_slots), group
    )
    shape[2] = host.num_blocks
    # [slots, K/V, cpu_blocks, block_size, kv_heads, head_dim], pinned for async copies
    cpu_cache = torch.zeros(shape, dtype=kv_dtype, pin_memory=device.type == "cuda")
    return kv_cache, cpu_cache, split, host


def _same_on_every_rank(split: PoolSplit, group: TensorParallel | None) -> PoolSplit:
    """The same block and slot ids everywhere: each count the smallest rank's."""
    if group is None:
        return split
    return dataclasses.replace(
        split,
        num_blocks=group.smallest(split.num_blocks),
        num_slots=group.smallest(split.num_slots),
        num_snapshots=group.smallest(split.num_snapshots),
    )
