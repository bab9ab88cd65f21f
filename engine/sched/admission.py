"""Admission: the waiting queue's head starts (prefix hits, disk loads, chunked prefill) or a
swapped-out request comes back, while the step's token budget and blocks last. A head held by
the partial-prefill limits lets a prompt behind it that finishes in one chunk start instead
(engine/sched/prefill_limits.py).

Mixed into Scheduler (engine/sched/scheduler.py), whose queues and block manager it works on.
"""

from collections import deque
from itertools import islice

from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.kv.block_manager import BlockManager
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.prefill_limits import PrefillSlot, prefill_slot, prompt_fits
from kvpager.engine.sched.step_plan import SchedulerStats, StepPlan

SHORT_JUMP_SCAN = 64  # waiting requests looked at for a short prompt behind a held one


class Admission:
    """The scheduler's waiting side: `_schedule_waiting` is what `schedule()` calls."""

    config: SchedulerConfig
    cache_config: CacheConfig
    block_manager: BlockManager | HybridBlockManager
    grouped: bool
    waiting: deque[Request]
    running: list[Request]
    stats: SchedulerStats

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue by (priority, arrival), vLLM's order: behind every request
        of its priority or a lower (more urgent) one."""
        idx = len(self.waiting)
        while idx and self.waiting[idx - 1].priority > request.priority:
            idx -= 1
        self.waiting.insert(idx, request)

    def _requeue(self, request: Request) -> None:
        """A preempted request goes back at the head of its priority's requests."""
        idx = 0
        while idx < len(self.waiting) and self.waiting[idx].priority < request.priority:
            idx += 1
        self.waiting.insert(idx, request)

    def _order_running(self) -> None:
        """Running requests by priority (stable: admission order within one), so a step
        serves urgent requests first and preemption, which takes the last, the least urgent."""
        if any(r.priority != self.running[0].priority for r in self.running):
            self.running.sort(key=lambda r: r.priority)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        if not self.block_manager.disk.listed:
            return  # the disk's listing first, so what it holds is found
        while self.waiting and plan.budget > 0:
            if self._resume_or_admit(self.waiting[0], plan):
                continue
            if plan.held_by_limits and self._admit_short_behind(plan):
                continue
            if self.running or plan.num_scheduled or not self.num_swapped:
                break
            # Nothing runs, yet the head cannot start: swapped requests hold shared device
            # blocks. Let them recompute instead, so the head always fits.
            for request in [r for r in self.waiting if r.status is RequestStatus.SWAPPED]:
                self._free_to_recompute(request)  # its CPU and shared device blocks
        self._prefetch_from_disk()

    def _admit_short_behind(self, plan: StepPlan) -> bool:
        """The head waits for a partial-prefill slot: the first fresh prompt behind it that
        finishes in one chunk (so takes no slot) starts instead (vLLM's queue jump)."""
        plan.held_by_limits = False
        for request in islice(self.waiting, 1, SHORT_JUMP_SCAN):
            num_tokens = request.num_tokens
            if (
                request.status is RequestStatus.WAITING
                and request.kv_import is None
                and self._chunk(request, num_tokens, plan.budget) >= num_tokens
            ):
                return self._resume_or_admit(request, plan)
        return False

    def _prefetch_from_disk(self) -> None:
        """Issue the disk reads of the first queued requests now, so they overlap the steps
        before their turn (engine/kv/disk_index.py)."""
        disk = self.block_manager.disk
        if not disk.enabled:
            return
        for request in islice(self.waiting, disk.prefetch_depth):
            if (
                request.status is RequestStatus.SWAPPED
                or request.sampling_params.prompt_logprobs is not None
                or request.kv_import is not None  # its blocks come from another instance
                or not disk.wants_prefetch(request)
            ):
                continue
            disk.prefetch(request, len(self._prefix_hits(request)))

    def _resume_or_admit(self, request: Request, plan: StepPlan) -> bool:
        if request.num_output_placeholders:
            return False  # preempted with a token in flight: resume once it has arrived
        if request.status is RequestStatus.SWAPPED:
            return self._swap_in(request, plan)
        if request.kv_import is not None and self._start_import(request):
            return True  # its blocks come from another instance first (kv_moves.py)
        room = self.config.max_num_seqs - self._num_seqs_in_use
        return room >= 1 + request.num_pending_forks and self._admit(request, plan)

    def _prefix_hits(self, request: Request) -> list:
        """The cached prefix, none for a request wanting prompt logprobs: it needs the logits
        of every prompt position (vLLM's rule)."""
        if request.sampling_params.prompt_logprobs is not None:
            return self.block_manager.find_cached_prefix(request, max_blocks=0)
        return self.block_manager.find_cached_prefix(request)

    def _start_disk_load(self, request: Request, hits: list) -> bool:
        """Read the blocks past the device and CPU hits from disk first (one full-attention
        group only: CacheConfig refuses a disk tier beside windows)."""
        disk = self.block_manager.disk
        if not disk.enabled or request.sampling_params.prompt_logprobs is not None:
            return False
        return disk.start_load(request, len(hits))

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        hits = self._prefix_hits(request)
        if self._start_disk_load(request, hits):
            self.waiting.remove(request)  # back at the head once its blocks are read
            return True
        num_hit_tokens = self.block_manager.num_hit_blocks(hits) * self.cache_config.block_size
        num_new = request.num_tokens - num_hit_tokens
        if num_new > plan.budget and not self.config.enable_chunked_prefill:
            return False
        num_chunk = self._chunk(request, num_new, plan.budget)
        if not self._may_start(request, num_new, num_chunk, hits, plan):
            return False
        num_new = num_chunk
        if self.block_manager.allocate_slots(request, num_new, hits) is None:
            return False
        self.waiting.remove(request)
        self.block_manager.disk.admitted(request, num_hit_tokens // self.cache_config.block_size)
        self._note_prefix_hits(request, num_hit_tokens, hits)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._note_running(request, num_new, [], plan)
        return True

    def _may_start(
        self, request: Request, num_new: int, num_chunk: int, hits: list, plan: StepPlan
    ) -> bool:
        """The partial-prefill limits and the block reservation (engine/sched/prefill_limits.py)
        let the prompt start now; a parent whose samples fork from it is never held."""
        if request.num_pending_forks:
            return True
        slot = prefill_slot(self.running, plan.num_scheduled, self.config, num_new, num_chunk)
        plan.held_by_limits = slot is not PrefillSlot.FREE
        if slot is not PrefillSlot.FREE:
            return False
        if not self.config.reserve_prompt_blocks:
            return True
        return prompt_fits(request, num_new, hits, self.running, self.block_manager)

    def _swap_in(self, request: Request, plan: StepPlan) -> bool:
        num_new = min(self._num_unscheduled(request), plan.budget)
        if self.block_manager.num_blocks_to_resume(request, num_new) > (
            self.block_manager.num_free_blocks
        ):
            return False
        self.waiting.popleft()
        self.block_manager.swap_in(request)
        grown = self.block_manager.allocate_slots(request, num_new)
        assert grown is not None, "swap-in reserved too little"
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        # the executor's row replaces its whole table
        full_table = self.block_manager.get_block_table(request.seq_id)
        copy = [list(t) for t in full_table] if self.grouped else list(full_table)
        self._note_running(request, num_new, copy, plan)
        return True

    def _note_prefix_hits(self, request: Request, num_hit_tokens: int, hits: list) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
            request.cached_tokens_by_tier = self._hits_by_tier(request, hits)
            self.stats.prefix_queried_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += num_hit_tokens

    def _hits_by_tier(self, request: Request, hits: list) -> dict[str, int]:
        """Hit tokens per tier: on the device, swapped in from the CPU pool, or read from
        disk into it for this admission (engine/kv/disk_index.py); tiers without hits left
        out."""
        hits = hits[0] if self.grouped else hits
        num_cpu = sum(hit.on_cpu for hit in hits)
        num_disk = min(num_cpu, request.num_disk_hit_blocks)
        blocks = {"device": len(hits) - num_cpu, "cpu": num_cpu - num_disk, "disk": num_disk}
        size = self.cache_config.block_size
        return {tier: count * size for tier, count in blocks.items() if count}
