"""Preemption: when blocks run out, a running request gives its device blocks back.

Swapped, its blocks move to the CPU pool and it resumes where it stopped; preempted to
recompute, its blocks are freed and its tokens computed again when it resumes. Either way it
goes back to the head of the waiting queue.
"""

from typing import TYPE_CHECKING

import structlog

from engine.request import Request, RequestStatus
from engine.step_plan import StepPlan

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Preemption:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler

    def mode(self, request: Request) -> str:
        """ "swap" or "recompute" for this request, by the configured mode and the CPU pool."""
        scheduler = self.scheduler
        mode = scheduler.config.preemption_mode
        if mode == "auto":
            # Recomputing a forked sample loses the prompt blocks it shared: swap those. On a
            # device cache, recomputing a lone request beats the copies (vLLM's choice too).
            forked = len(scheduler.groups.get(request.group_id, ())) > 1
            mode = "swap" if forked or scheduler.cache_config.swap_is_cheap else "recompute"
        if mode == "swap" and not (
            scheduler.block_manager.cpu.enabled and scheduler.block_manager.can_swap_out(request)
        ):
            mode = "recompute"
        return mode

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Swap the request's blocks out, or free them to recompute its tokens later."""
        # Victims come from the end of `running`. Samples forked in this step sit behind
        # their parent, and every request behind the parent was admitted after its last
        # prompt chunk, which takes the whole budget unless it completes: none can need blocks.
        assert request.request_id not in plan.forked, f"{request.request_id}: forked this step"
        scheduler, mode = self.scheduler, self.mode(request)
        if mode == "swap":
            scheduler.block_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            scheduler.num_swapped += 1
            scheduler.stats.num_swap_preemptions += 1
        else:
            self._free_to_recompute(request)
        request.num_preemptions += 1
        scheduler.stats.num_preemptions += 1
        scheduler.waiting.appendleft(request)
        log.debug("preempted", request_id=request.request_id, mode=mode)

    def drop_swapped(self, request: Request) -> None:
        """A swapped request gives its CPU and shared device blocks back; it will recompute."""
        self.scheduler.num_swapped -= 1
        self._free_to_recompute(request)

    def _free_to_recompute(self, request: Request) -> None:
        self.scheduler.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.scheduler.forget_at_executor(request.request_id)
