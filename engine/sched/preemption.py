"""Preemption: when blocks run out, the least urgent running request (the highest `priority`
value, then the newest) gives its blocks back.

It is swapped to the CPU pool (its private blocks move there, shared ones stay referenced) or
freed and recomputed later; either way it goes back to the head of the waiting queue. Mixed
into Scheduler (engine/sched/scheduler.py), whose queues and block manager it works on.
"""

from collections import deque

import structlog
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.kv.block_manager import BlockManager
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.step_plan import SchedulerStats, StepPlan

log = structlog.get_logger(__name__)


class Preemption:
    """The scheduler's preemption: `_allocate_or_preempt` is what scheduling calls."""

    config: SchedulerConfig
    cache_config: CacheConfig
    block_manager: BlockManager | HybridBlockManager
    waiting: deque[Request]
    running: list[Request]
    groups: dict[str, list[Request]]
    stats: SchedulerStats

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan):
        while True:
            new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._pick_victim(request, plan)
            self._preempt(victim, plan)
            plan.preempted.append(victim)
            if victim is request:
                return None

    def _pick_victim(self, request: Request, plan: StepPlan) -> Request:
        """The last running request (running is in priority order: the least urgent, then
        the newest), skipping samples forked in this step; at worst `request` itself. Those
        before `request` were scheduled in this step already."""
        for idx in range(len(self.running) - 1, -1, -1):
            candidate = self.running[idx]
            if candidate is request or candidate.seq_id not in plan.forked:
                return self.running.pop(idx)
        raise AssertionError(f"{request.seq_id}: not running")

    def _preemption_mode(self, request: Request) -> str:
        """ "swap" or "recompute" for this request, by the configured mode and the CPU pool."""
        mode = self.config.preemption_mode
        if mode == "auto":
            # Recomputing a forked sample loses the prompt blocks it shared: swap those. On a
            # device cache, recomputing a lone request beats the copies (vLLM's choice too).
            forked = len(self.groups.get(request.request_id, ())) > 1
            mode = "swap" if forked or self.cache_config.swap_is_cheap else "recompute"
        manager = self.block_manager
        if mode == "swap" and not (manager.cpu.enabled and manager.can_swap_out(request)):
            mode = "recompute"
        return mode

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Swap the request's blocks out, or free them to recompute its tokens later; either way
        it goes back to the head of the waiting queue."""
        # Victims come from the end of `running`. Samples forked in this step sit behind
        # their parent, and every request behind the parent was admitted after its last
        # prompt chunk, which takes the whole budget unless it completes: none can need blocks.
        assert request.seq_id not in plan.forked, f"{request.seq_id}: forked this step"
        mode = self._preemption_mode(request)
        request.spec_token_ids = []  # resumed, it decodes one token before proposing again
        if mode == "swap":
            self.block_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.stats.num_swap_preemptions += 1
        else:
            self._free_to_recompute(request)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._requeue(request)
        log.debug("preempted", request_id=request.seq_id, mode=mode)

    def _free_to_recompute(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.forget_at_executor(request.seq_id)
