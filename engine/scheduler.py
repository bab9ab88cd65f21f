"""Scheduler: continuous batching under one rule, with the block manager's accounting.

Every request has `num_computed_tokens` and a target, `num_tokens` (prompt + outputs so far).
Each step hands out a token budget, running requests first, until computed catches up; a
request whose computed tokens reach its target this step gets a sampled token. Prefill,
chunked prefill, prefix hits and decode all fall out of that rule. When blocks run out, the
newest running request is preempted (its blocks freed, recomputed later).
"""

from collections import deque
from dataclasses import dataclass, field

import structlog

from engine.block_manager import BlockManager
from engine.config import CacheConfig, SchedulerConfig
from engine.errors import InvalidRequestError, RequestTooLongError
from engine.request import Request, RequestStatus
from schemas.executor import CachedRequest, NewRequest, ScheduledStep
from schemas.scheduler import StepOutput

log = structlog.get_logger(__name__)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class _StepPlan:
    """What one schedule() call decided, before it is turned into a ScheduledStep."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.at_executor: set[str] = set()  # requests whose state the executor holds
        self.finished_req_ids: list[str] = []  # to tell the executor next step
        self.stats = SchedulerStats()
        self.step_id = 0

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise a typed error if it can never run."""
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request_id: {request.request_id!r} is already in flight", param="request_id"
            )
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        self._check_fits(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise InvalidRequestError("the waiting queue is full", param=None)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        max_len, block_size = self.config.max_model_len, self.cache_config.block_size
        if request.max_num_tokens > max_len:
            raise RequestTooLongError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) exceeds max_model_len ({max_len})",
                param="max_tokens" if request.num_prompt_tokens < max_len else "prompt",
            )
        if -(-request.max_num_tokens // block_size) > self.cache_config.num_blocks:
            raise RequestTooLongError(
                f"prompt + max_tokens ({request.max_num_tokens} tokens) exceeds the whole KV "
                f"cache ({self.cache_config.num_slots} token slots)",
                param="max_tokens",
            )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledStep:
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self.step_id += 1
        self._record_usage()
        step = ScheduledStep(
            step_id=self.step_id,
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            num_scheduled_tokens=plan.num_scheduled,
            finished_req_ids=self.finished_req_ids,
            blocks_to_copy=self.block_manager.take_copies(),
        )
        self.finished_req_ids = []
        return step

    def _schedule_running(self, plan: _StepPlan) -> None:
        idx = 0
        while idx < len(self.running) and plan.budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            new_block_ids = self._allocate_or_preempt(request, num_new, plan)
            if new_block_ids is None:
                break  # the request itself was preempted: nothing newer is left to run
            self._note_running(request, num_new, new_block_ids, plan)
            idx += 1

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan):
        while True:
            new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None

    def _note_running(self, request: Request, num_new: int, new_block_ids, plan) -> None:
        plan.budget -= num_new
        plan.num_scheduled[request.request_id] = num_new
        if request.request_id not in self.at_executor:
            plan.new_requests.append(self._new_request_data(request))
            self.at_executor.add(request.request_id)
            return
        # Copy-on-write may replace the shared tail block, so new ids overwrite the table
        # from this index rather than always being appended.
        table = self.block_manager.get_block_table(request.request_id)
        replace_from = len(table) - len(new_block_ids)
        plan.cached_requests.append(
            CachedRequest(
                req_id=request.request_id,
                num_computed_tokens=request.num_computed_tokens,
                new_block_ids=new_block_ids,
                replace_from=replace_from,
            )
        )

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.block_manager.find_cached_prefix(request)
            num_hit_tokens = len(hits) * self.cache_config.block_size
            num_new = request.num_tokens - num_hit_tokens
            if num_new > plan.budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, plan.budget)
            if self.block_manager.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            self._note_prefix_hits(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._note_running(request, num_new, [], plan)

    def _note_prefix_hits(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
            self.stats.prefix_queried_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += num_hit_tokens

    def _new_request_data(self, request: Request) -> NewRequest:
        return NewRequest(
            req_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=list(self.block_manager.get_block_table(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes its tokens when it runs again."""
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._forget_at_executor(request.request_id)
        self.waiting.appendleft(request)
        log.debug("preempted", request_id=request.request_id, mode="recompute")

    def _forget_at_executor(self, request_id: str) -> None:
        if request_id in self.at_executor:
            self.at_executor.discard(request_id)
            self.finished_req_ids.append(request_id)

    def update_from_output(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that stop.

        Returns the requests that got a new token this step (finished ones included).
        """
        assert output.step_id == step.step_id, f"step {output.step_id} != {step.step_id}"
        sampled = dict(zip(output.req_ids, output.sampled_token_ids))
        updated = []
        for req_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since the step was planned
            request.num_computed_tokens += num_tokens
            token_id = sampled.get(req_id)
            if token_id is None:
                continue  # a prefill chunk that has not reached the end of the prompt
            request.output_token_ids.append(token_id)
            updated.append(request)
            status = request.check_stop()
            if status is not None:
                self.finish(request, status)
        return updated

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish a request (stop, length, stop string or abort) and free its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        self._forget_at_executor(request.request_id)
        self.requests.pop(request.request_id, None)
        self.stats.finished[status.value] = self.stats.finished.get(status.value, 0) + 1

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def _record_usage(self) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.peak_used_blocks = max(stats.peak_used_blocks, self.block_manager.num_used_blocks)
        stats.peak_running = max(stats.peak_running, len(self.running))

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        for request in self.running:
            assert request.request_id in self.block_manager.block_tables, request.request_id
        for request in self.waiting:
            assert request.request_id not in self.block_manager.block_tables, request.request_id
