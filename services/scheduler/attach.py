"""What an attached executor decides: the SchedulerInfo others see."""

from kvpager.schemas.scheduler import ExecutorReady, SchedulerInfo


def scheduler_info(
    scheduler_id: str,
    ready: ExecutorReady | None,
    num_kv_held: int = 0,
    num_unfinished: int = 0,
) -> SchedulerInfo:
    if ready is None:
        return SchedulerInfo(executor_attached=False, scheduler_id=scheduler_id)
    return SchedulerInfo(
        executor_attached=True,
        model=ready.model,
        max_model_len=ready.max_model_len,
        vocab_size=ready.vocab_size,
        scheduler_id=scheduler_id,
        executor_id=ready.executor_id,
        num_kv_held=num_kv_held,
        num_unfinished=num_unfinished,
    )
