"""Scheduler: continuous batching under one rule, with the block manager's accounting.

Every request has `num_computed_tokens` and a target, `num_tokens` (prompt + outputs so far)
plus the tokens still being sampled by steps in flight. Each step hands out a token budget,
running requests first, until computed catches up; a request whose computed tokens reach its
target this step gets a sampled token. Prefill, chunked prefill, prefix hits and decode all
fall out of that rule. When blocks run out, the newest running request is preempted: swapped to
the CPU pool or freed and recomputed later.

`schedule()` counts the tokens it schedules as computed at once, and a sampling request gets a
placeholder for its coming token, so the engine core can plan the next step before this one's
output arrives (engine/core.py, as vLLM's async scheduling). `update_from_output()` then only
appends tokens; a request that stops has one extra step computed, whose token is dropped.
"""

from collections import deque

import msgspec
import structlog
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.kv.hybrid_manager import HybridBlockManager, make_block_manager
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.beam_scheduler import BeamScheduler
from kvpager.engine.sched.beam_search import FinishedBeam
from kvpager.engine.sched.lookahead import Lookahead
from kvpager.engine.sched.request_checks import check_request_fits
from kvpager.engine.sched.step_plan import SchedulerStats, StepPlan
from kvpager.schemas.errors import InvalidRequestError, OverloadedError
from kvpager.schemas.executor import ForkRequest, ScheduledStep
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import StepOutput

log = structlog.get_logger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = make_block_manager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.num_cpu_blocks,
            cache_config.group_windows,
            cache_config.enable_disk,
        )
        self.grouped = isinstance(self.block_manager, HybridBlockManager)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.seqs: dict[str, Request] = {}  # seq id -> its sample
        self.groups: dict[str, list[Request]] = {}  # request id -> its parallel samples
        self.beams = BeamScheduler()
        self.lookahead = Lookahead(scheduler_config.speculative_config)
        self.at_executor: set[str] = set()  # requests whose state the executor holds
        self.finished_seq_ids: list[str] = []  # to tell the executor next step
        self._sampling: dict[int, list[Request]] = {}  # step id -> who samples in it
        self.failed: dict[str, ErrorInfo] = {}  # request id -> why it failed, for the core
        self.stats = SchedulerStats()
        self.step_id = 0

    def add_request(self, request: Request) -> None:
        """Queue a request (n > 1 samples fork from it later), or raise a typed error."""
        self.check_request(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise OverloadedError(f"the waiting queue is full ({self.config.max_waiting})")
        params = request.sampling_params
        request.num_pending_forks = max(params.n, params.beam_width) - 1
        self.seqs[request.seq_id] = request
        self.groups[request.request_id] = [request]
        if params.is_beam_search:
            self.beams.start(request)
        self.waiting.append(request)
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self.waiting))

    def check_request(self, request: Request) -> None:
        """Raise a typed error if the request can never run; no side effects."""
        if request.seq_id in self.seqs or request.request_id in self.groups:
            raise InvalidRequestError(
                f"request_id: {request.seq_id!r} is already in flight", param="request_id"
            )
        check_request_fits(request, self.config, self.cache_config)

    @property
    def can_plan_ahead(self) -> bool:
        """Whether the next step may be planned before this one's output arrives. Not during a
        beam search: its beams advance only when the search has chosen their tokens. Nor after
        a step that verifies or asks for proposals (engine/sched/lookahead.py)."""
        return not self.beams.groups and not self.lookahead.lockstep

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.block_manager.disk.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.block_manager.disk.waiting)

    @property
    def num_swapped(self) -> int:
        """Requests whose blocks wait in the CPU pool (the block manager keeps their tables)."""
        return len(self.block_manager.swapped_tables)

    @property
    def _num_seqs_in_use(self) -> int:
        """Running and swapped sequences plus the samples running parents will fork."""
        pending = sum(r.num_pending_forks for r in self.running)
        return len(self.running) + self.num_swapped + pending

    def schedule(self) -> ScheduledStep:
        plan = StepPlan(budget=self.config.max_num_batched_tokens, grouped=self.grouped)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self.step_id += 1
        self._sampling[self.step_id] = plan.sampling
        asks = self.lookahead.asks(plan.sampling, len(self.running))
        verified = {seq_id: len(drafts) for seq_id, drafts in plan.spec_token_ids.items()}
        self.lookahead.planned(self.step_id, verified, asks)
        self.stats.record_step(self.block_manager.num_used_blocks, len(self.running))
        ops = self.block_manager.take_ops()
        step = ScheduledStep(
            step_id=self.step_id,
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            num_scheduled_tokens=plan.num_scheduled,
            finished_seq_ids=self.finished_seq_ids,
            blocks_to_copy=ops.copy,
            blocks_to_swap_out=ops.swap_out,
            blocks_to_swap_in=ops.swap_in,
            blocks_to_disk=ops.to_disk,
            blocks_from_disk=ops.from_disk,
            forks=self.beams.take_forks() + plan.forks,
            num_spec_tokens=asks,
        )
        self.finished_seq_ids = []
        return step

    def _schedule_running(self, plan: StepPlan) -> None:
        idx = 0
        while idx < len(self.running) and plan.budget > 0:
            request = self.running[idx]
            if request.seq_id in plan.forked:
                idx += 1  # made from its parent's logits in this step: nothing to compute
                continue
            num_new = self._chunk(request, self._num_unscheduled(request), plan.budget)
            if num_new == 0:  # a beam waiting for its siblings, or the last token in flight
                idx += 1
                continue
            drafts = self.lookahead.drafts_to_verify(
                request, num_new, plan.budget, len(self.running)
            )
            num_new += len(drafts)
            new_block_ids = self._allocate_or_preempt(request, num_new, plan)
            if new_block_ids is None:
                break  # the request itself was preempted: nothing newer is left to run
            if drafts:
                plan.spec_token_ids[request.seq_id] = drafts
            self._note_running(request, num_new, new_block_ids, plan)
            idx += 1

    def _chunk(self, request: Request, num_new: int, budget: int) -> int:
        """The tokens `request` computes this step: at most the budget and at most
        `long_prefill_token_threshold`, so one long prompt cannot hold the whole budget for
        many steps (vLLM's rule; capping only while others wait was measured to leave a
        request arriving just after it behind the steps already planned at full budget). A
        parent whose samples fork from it is not capped: its chunks take the budget until its
        prompt completes, so nothing admitted behind it can need the blocks of samples forked
        in the same step (see _preempt)."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new and not request.num_pending_forks:
            num_new = threshold
        return min(num_new, budget)

    @staticmethod
    def _num_unscheduled(request: Request) -> int:
        """Tokens neither computed nor scheduled: the known ones plus those being sampled."""
        in_flight = request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        if in_flight and request.num_output_tokens + in_flight >= max_tokens:
            return 0  # it finishes by length once the tokens in flight arrive
        return request.num_tokens + in_flight - request.num_computed_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan):
        while True:
            new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim, plan)
            plan.preempted.append(victim)
            if victim is request:
                return None

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
        self.waiting.appendleft(request)
        log.debug("preempted", request_id=request.seq_id, mode=mode)

    def _free_to_recompute(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.forget_at_executor(request.seq_id)

    def _note_running(self, request: Request, num_new: int, new_block_ids, plan) -> None:
        plan.budget -= num_new
        plan.num_scheduled[request.seq_id] = num_new
        new_token_ids = self.beams.pop_token(request.seq_id)
        table = self.block_manager.get_block_table(request.seq_id)
        if request.seq_id not in self.at_executor:
            plan.add_new(request, table)
            self.at_executor.add(request.seq_id)
        else:
            plan.add_cached(request, table, new_block_ids, new_token_ids)
        request.num_computed_tokens += num_new
        if request.num_computed_tokens < request.num_tokens + request.num_output_placeholders:
            return  # a prefill chunk short of the prompt's end: nothing is sampled
        plan.sampling.append(request)
        if self._is_beam(request):
            return  # beams get their tokens from the beam search, after the step
        request.num_output_placeholders += 1
        if request.num_pending_forks:
            self._fork_samples(request, plan)

    @staticmethod
    def _is_beam(request: Request) -> bool:
        return request.sampling_params.is_beam_search

    def _fork_samples(self, parent: Request, plan: StepPlan) -> None:
        """The parent's prompt completes this step: its other samples share its blocks."""
        params = parent.sampling_params
        for index in range(1, parent.num_pending_forks + 1):
            # wraps, so a seed near the top of its range still gives each sample a valid one
            seed = None if params.seed is None else (params.seed + index) % 2**63
            # the child copies the parent's computed prompt and its token in flight, so it is
            # not scheduled again in this step when the loop reaches it
            child = parent.fork(
                f"{parent.seq_id}#{index}",
                sampling_params=msgspec.structs.replace(params, seed=seed),
                sample_index=index,
            )
            child.num_output_placeholders = 1  # its first token: from the parent's logits
            self.add_forked(parent, child)
            plan.forks.append(ForkRequest(parent.seq_id, child.seq_id, seed))
            plan.sampling.append(child)
            plan.forked.add(child.seq_id)
        parent.num_pending_forks = 0

    def add_forked(self, parent: Request, child: Request) -> None:
        """Register a running child that shares all of its parent's blocks."""
        self.block_manager.fork(parent, child)
        self.seqs[child.seq_id] = child
        self.groups[parent.request_id].append(child)
        self.running.append(child)
        self.at_executor.add(child.seq_id)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        if not self.block_manager.disk.listed:
            return  # the disk's listing first, so what it holds is found
        while self.waiting and plan.budget > 0:
            if self._resume_or_admit(self.waiting[0], plan):
                continue
            if self.running or plan.num_scheduled or not self.num_swapped:
                break
            # Nothing runs, yet the head cannot start: swapped requests hold shared device
            # blocks. Let them recompute instead, so the head always fits.
            for request in [r for r in self.waiting if r.status is RequestStatus.SWAPPED]:
                self._free_to_recompute(request)  # its CPU and shared device blocks

    def _resume_or_admit(self, request: Request, plan: StepPlan) -> bool:
        if request.num_output_placeholders:
            return False  # preempted with a token in flight: resume once it has arrived
        if request.status is RequestStatus.SWAPPED:
            return self._swap_in(request, plan)
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
        return disk.start_load(request, len(hits), sum(hit.on_cpu for hit in hits))

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        hits = self._prefix_hits(request)
        if self._start_disk_load(request, hits):
            self.waiting.popleft()  # back at the head once its blocks are read
            return True
        num_hit_tokens = self.block_manager.num_hit_blocks(hits) * self.cache_config.block_size
        num_new = request.num_tokens - num_hit_tokens
        if num_new > plan.budget and not self.config.enable_chunked_prefill:
            return False
        num_new = self._chunk(request, num_new, plan.budget)
        if self.block_manager.allocate_slots(request, num_new, hits) is None:
            return False
        self.waiting.popleft()
        self.block_manager.disk.admitted(request)
        self._note_prefix_hits(request, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._note_running(request, num_new, [], plan)
        return True

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

    def _note_prefix_hits(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
            self.stats.prefix_queried_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += num_hit_tokens

    def forget_at_executor(self, request_id: str) -> None:
        self.beams.pop_token(request_id)  # a resumed request sends all its tokens
        if request_id in self.at_executor:
            self.at_executor.discard(request_id)
            self.finished_seq_ids.append(request_id)

    def update_from_output(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Append sampled tokens and finish requests that stop (computed counts moved already).

        Returns the requests that got a new token this step (finished ones included). A token
        for a request preempted since the step was planned is kept: it was computed from the
        right context. One for a finished request is dropped.
        """
        assert output.step_id == step.step_id, f"step {output.step_id} != {step.step_id}"
        self.waiting.extendleft(reversed(self.block_manager.disk.apply(output)))
        emitted = {seq_id: output.emitted_token_ids(i) for i, seq_id in enumerate(output.seq_ids)}
        for abandoned in [s for s in self._sampling if s < step.step_id]:
            del self._sampling[abandoned]  # outputs come in order: theirs never will
        self._fail_rows(output.failed)
        updated = []
        for request in self._sampling.pop(step.step_id, []):
            try:
                updated += self._update_one(request, output, emitted)
            except Exception as exc:  # one request's failure ends that request alone
                self.fail(request.request_id, exc)
        self.lookahead.end_step(step.step_id)
        return [request for request in updated if request.request_id not in self.failed]

    def _update_one(self, request: Request, output: StepOutput, emitted: dict[str, list[int]]):
        if self._is_beam(request):
            if request.status is RequestStatus.RUNNING:
                self._report_beam(request, output.beam_candidates.get(request.seq_id))
            return []
        request.num_output_placeholders -= 1
        if request.is_finished:
            return []
        return self._append_sampled(request, output, emitted)

    def fail(self, request_id: str, exc: Exception) -> None:
        """End every sample of a request whose output, parameters or beams raised: its blocks
        are freed, and `take_failed()` hands its error to the engine core."""
        log.exception("request failed", request_id=request_id)
        self.abort(request_id)
        message = f"the request failed while its output was processed: {exc!r}"
        self.failed[request_id] = ErrorInfo(getattr(exc, "type", "internal_error"), message)

    def _fail_rows(self, failed: dict[str, str]) -> None:
        """Samples the executor could not constrain to their grammar: each request ends alone
        with a typed error (never unconstrained)."""
        for seq_id, message in failed.items():
            request = self.seqs.get(seq_id)
            if request is not None and request.request_id not in self.failed:
                self.abort(request.request_id)
                self.failed[request.request_id] = ErrorInfo("invalid_request", message)

    def take_failed(self) -> dict[str, ErrorInfo]:
        """Requests failed since the last call: request id -> its error."""
        failed, self.failed = self.failed, {}
        return failed

    def _report_beam(self, beam: Request, candidates: list[tuple[int, float]] | None) -> None:
        """Apply a beam group's selection once all its live beams have reported."""
        selection = self.beams.report(beam, candidates, self.groups[beam.request_id])
        if selection is None:
            return
        for source, child in selection.forks:
            self.add_forked(source, child)
        for ended in selection.ended:
            self.finish(ended, RequestStatus.FINISHED_STOPPED)

    def _append_sampled(self, request: Request, output: StepOutput, emitted) -> list[Request]:
        """Append the step's tokens one by one: a stop or max_tokens in the middle of an
        accepted run finishes the request there and drops the tokens after it."""
        token_ids = emitted.get(request.seq_id)
        assert token_ids, f"step output lacks {request.seq_id}'s token"
        self.lookahead.roll_back(output.step_id, request, len(token_ids), self.block_manager)
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            status = request.check_stop()
            if status is not None:
                self.finish(request, status)
                return [request]
        self.lookahead.take_drafts(request, output.draft_token_ids.get(request.seq_id))
        return [request]

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish one sequence (stop, length, stop string or abort) and free its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.disk.forget(request)
        request.status = status
        request.num_pending_forks = 0
        self.block_manager.free(request)
        self.forget_at_executor(request.seq_id)
        self.lookahead.forget(request.seq_id)
        self.seqs.pop(request.seq_id, None)
        group = self.groups.get(request.request_id, [])
        if all(r.is_finished for r in group):
            self.groups.pop(request.request_id, None)
            self.beams.groups.pop(request.request_id, None)
        self.stats.finished[status.value] = self.stats.finished.get(status.value, 0) + 1

    def take_beam_results(self) -> dict[str, list[FinishedBeam]]:
        """Finished beam searches since the last call: request id -> best beams, best first."""
        return self.beams.take_results()

    def abort(self, request_id: str) -> bool:
        """Abort every sample of a request; False if it is unknown or already finished."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for request in list(group):
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def check_invariants(self) -> None:
        manager = self.block_manager
        manager.check_invariants()
        for request in self.running:
            assert request.seq_id in manager.block_tables, request.seq_id
            assert request.num_output_placeholders >= 0, request.seq_id
        for request in self.waiting:
            assert request.seq_id not in manager.block_tables, request.seq_id
            swapped = request.status is RequestStatus.SWAPPED
            assert swapped == (request.seq_id in manager.swapped_tables), request.seq_id
