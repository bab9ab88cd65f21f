"""What an executor gives its KV transfer: its cache's regions and the per-layer fp8 scales."""

from kvpager.engine.worker.executor import Executor
from kvpager.engine.worker.kv_transfer.regions import KvRegions


def executor_regions(executor: Executor) -> KvRegions | None:
    """The executor's cache as transfer regions; None under tensor parallelism (each rank
    holds a shard of every block: not supported yet, streams there recompute)."""
    if executor.shard.world_size > 1:
        return None
    layers = getattr(executor.model, "layers", [])
    scales = [float(s) for layer in layers for s in (layer.k_scale, layer.v_scale)]
    return KvRegions(executor.kv_cache, executor.ops.kv_layout, scales)
