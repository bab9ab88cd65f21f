"""The Stats of one engine (a scheduler and its executor), read off the scheduler, its block
manager and the core's metrics: `llm.stats` over NATS and `LLM.stats()` offline alike."""

from kvpager.engine.sched.metrics import EngineMetrics
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.public import Stats


def build_stats(instance: str, core: Scheduler, metrics: EngineMetrics) -> Stats:
    stats = core.stats
    queried = stats.prefix_queried_tokens
    return Stats(
        instance=instance,
        peak_used_blocks=stats.peak_used_blocks,
        peak_running=stats.peak_running,
        peak_waiting=stats.peak_waiting,
        num_running=len(core.running),
        num_waiting=len(core.waiting),
        num_preemptions=stats.num_preemptions,
        num_swap_preemptions=stats.num_swap_preemptions,
        num_steps=stats.num_steps,
        num_finished=dict(stats.finished),
        prefix_cache_queried_tokens=queried,
        prefix_cache_hit_tokens=stats.prefix_hit_tokens,
        prefix_cache_hit_rate=round(stats.prefix_hit_tokens / queried, 4) if queried else 0.0,
        spec_decode_num_drafts=core.lookahead.stats.num_drafts,
        spec_decode_num_draft_tokens=core.lookahead.stats.num_draft_tokens,
        spec_decode_num_accepted_tokens=core.lookahead.stats.num_accepted_tokens,
        **_block_fields(core),
        **_transfer_fields(core),
        **_snapshot_fields(core),
        **_state_pool_fields(core),
        **_timing_fields(metrics),
    )


def _block_fields(core: Scheduler) -> dict:
    """The device pool and the tiers under it."""
    manager = core.block_manager
    return dict(
        num_cpu_blocks=manager.cpu.num_blocks,
        num_swapped_out_blocks=manager.num_swapped_out_blocks,
        num_swapped_in_blocks=manager.num_swapped_in_blocks,
        num_evictions=manager.num_evictions,
        num_block_copies=manager.num_copies,
        num_disk_blocks=len(manager.disk.on_disk),
        num_disk_stored_blocks=manager.disk.num_stored_blocks,
        num_disk_loaded_blocks=manager.disk.num_loaded_blocks,
        num_disk_failed_loads=manager.disk.num_failed_loads,
        num_disk_prefetched_blocks=manager.disk.num_prefetched_blocks,
        num_disk_prefetch_dropped_blocks=manager.disk.holds.num_dropped_reads,
        num_disk_rejected_files=manager.disk.num_rejected_files,
        num_blocks=manager.num_blocks,
        block_size=manager.block_size,
        num_used_blocks=manager.num_used_blocks,
        num_free_blocks=manager.num_free_blocks,
        num_cached_blocks=manager.num_cached_blocks,
        num_pinned_blocks=manager.pool.pins.num_pinned,
        num_pinned_evictions=manager.pool.pins.num_pinned_evictions,
    )


def _transfer_fields(core: Scheduler) -> dict:
    """KV blocks moved between instances (engine/sched/kv_moves.py)."""
    kv = core.kv_stats
    return dict(
        kv_transfer_blocks=kv.num_blocks,
        kv_transfer_bytes=kv.num_bytes,
        kv_transfer_mean_ms=kv.mean_ms,
        kv_transfer_failed=kv.num_failed,
        kv_handoffs=kv.num_held,
    )


def _state_pool_fields(core: Scheduler) -> dict:
    """Recurrent models: the state rows carved out of the KV budget (engine/kv/state_pool.py)."""
    manager = core.block_manager
    if not hasattr(manager, "take_state_ops"):
        return {}
    return dict(
        num_state_slots=manager.slots.num_slots,
        num_free_state_slots=manager.slots.num_free,
        num_state_snapshot_slots=manager.num_snapshot_slots,
        state_slot_bytes=manager.slot_bytes,
    )


def _snapshot_fields(core: Scheduler) -> dict:
    """Recurrent models' prefix snapshots (engine/kv/state_snapshots.py), apart from blocks."""
    snapshots = getattr(core.block_manager, "snapshots", None)
    if snapshots is None:
        return {}
    host = snapshots.host
    num_on_host = host.num_held if host is not None else 0
    return dict(
        state_snapshot_hits=snapshots.num_hits,
        state_snapshot_hit_tokens=snapshots.num_hit_tokens,
        num_state_snapshots=snapshots.num_held,
        state_snapshot_bytes=snapshots.num_held * snapshots.slot_bytes,
        num_host_state_snapshots=num_on_host,
        host_state_snapshot_bytes=num_on_host * snapshots.slot_bytes,
        host_state_snapshot_hits=host.num_hits if host is not None else 0,
    )


def _timing_fields(metrics: EngineMetrics) -> dict:
    return dict(
        num_generated_tokens=metrics.throughput.total,
        tokens_per_s=metrics.throughput.per_second(),
        ttft_ms=metrics.ttft.percentiles(),
        itl_ms=metrics.itl.percentiles(),
        step_ms=metrics.step.percentiles(),
        executor_wait_ms=metrics.executor_wait.percentiles(),
        num_prompt_tokens=metrics.num_prompt_tokens,
        ttft_s=metrics.ttft.buckets.histogram(),
        itl_s=metrics.itl.buckets.histogram(),
        e2e_s=metrics.e2e.histogram(),
        queue_s=metrics.queue.histogram(),
    )
