"""What an attached executor decides: the engine Scheduler sized for it, and SchedulerInfo."""

from engine.config import CacheConfig, SchedulerConfig
from engine.scheduler import Scheduler
from schemas.scheduler import ExecutorReady, SchedulerInfo
from services.settings import Settings


def build_core(settings: Settings, ready: ExecutorReady) -> Scheduler:
    """A fresh engine Scheduler for the executor's capacity (its cache starts empty)."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=min(settings.max_num_seqs, ready.max_num_seqs),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=ready.max_model_len,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        preemption_mode=settings.preemption_mode,
        max_waiting=settings.max_waiting,
    )
    cache_config = CacheConfig(
        ready.block_size,
        ready.num_blocks,
        settings.enable_prefix_caching,
        ready.num_cpu_blocks,
        swap_is_cheap=ready.kv_on_host,
    )
    return Scheduler(scheduler_config, cache_config)


def scheduler_info(scheduler_id: str, ready: ExecutorReady | None) -> SchedulerInfo:
    if ready is None:
        return SchedulerInfo(executor_attached=False, scheduler_id=scheduler_id)
    return SchedulerInfo(
        executor_attached=True,
        model=ready.model,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        scheduler_id=scheduler_id,
        executor_id=ready.executor_id,
    )
