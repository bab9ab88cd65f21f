"""Scheduler: continuous batching under one rule, with the block manager's accounting.

Every request has `num_computed_tokens` and a target, `num_tokens` (prompt + outputs so far)
plus the tokens still being sampled by steps in flight. Each step hands out a token budget,
running requests first, until computed catches up; a request whose computed tokens reach its
target this step gets a sampled token. Prefill, chunked prefill, prefix hits and decode all
fall out of that rule. When blocks run out, the newest running request is preempted: swapped to
the CPU pool or freed and recomputed later.

The parts live beside it, each mixed into Scheduler: admission.py (the waiting queue),
preemption.py (when blocks run out) and output_update.py (a step's output coming back).

`schedule()` counts the tokens it schedules as computed at once, and a sampling request gets a
placeholder for its coming token, so the engine core can plan the next step before this one's
output arrives (engine/core.py, as vLLM's async scheduling). `update_from_output()` then only
appends tokens; a request that stops has one extra step computed, whose token is dropped.
"""

from collections import deque

import msgspec
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.kv.hybrid_manager import HybridBlockManager, make_block_manager
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.admission import Admission
from kvpager.engine.sched.beam_scheduler import BeamScheduler
from kvpager.engine.sched.beam_search import FinishedBeam
from kvpager.engine.sched.kv_moves import KvMoves
from kvpager.engine.sched.lookahead import Lookahead
from kvpager.engine.sched.output_update import OutputUpdate
from kvpager.engine.sched.preemption import Preemption
from kvpager.engine.sched.request_checks import check_request_fits
from kvpager.engine.sched.step_plan import SchedulerStats, StepPlan
from kvpager.schemas.errors import InvalidRequestError, OverloadedError
from kvpager.schemas.executor import ForkRequest, ScheduledStep
from kvpager.schemas.public import ErrorInfo


class Scheduler(Admission, Preemption, OutputUpdate, KvMoves):
    """The one scheduling rule over running and waiting requests (see the module docstring)."""

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
            cache_config.num_state_slots,
            cache_config.num_snapshot_slots,
            cache_config.state_slot_bytes,
            (cache_config.num_host_state_slots, cache_config.num_host_snapshot_slots),
        )
        inner = getattr(self.block_manager, "inner", self.block_manager)  # recurrent: state_slots
        self.grouped = isinstance(inner, HybridBlockManager)
        self.block_manager.pool.set_pin_limits(
            cache_config.max_pinned_blocks, cache_config.max_pinned_blocks_per_key
        )
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
        self._init_kv_moves()

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
        self._enqueue(request)
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
        return bool(
            self.waiting or self.running or self.block_manager.disk.waiting or self.importing
        )

    @property
    def num_unfinished(self) -> int:
        """The requests `has_unfinished` looks at, counted."""
        waiting_on_kv = len(self.block_manager.disk.waiting) + len(self.importing)
        return len(self.waiting) + len(self.running) + waiting_on_kv

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
        """One step: running requests first, then the waiting queue, while the budget lasts
        (admission.py); a request that finds no blocks preempts the newest (preemption.py)."""
        plan = StepPlan(budget=self.config.max_num_batched_tokens, grouped=self.grouped)
        self._order_running()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self.step_id += 1
        self._sampling[self.step_id] = plan.sampling
        asks = self._plan_lookahead(plan)
        self.stats.record_step(self.block_manager.num_used_blocks, len(self.running))
        return self._scheduled_step(plan, asks)

    def _plan_lookahead(self, plan: StepPlan) -> dict[str, int]:
        """Who is asked for proposals after this step (seq id -> how many), noted with the
        proposals this step verifies."""
        asks = self.lookahead.asks(plan.sampling, len(self.running))
        verified = {seq_id: len(drafts) for seq_id, drafts in plan.spec_token_ids.items()}
        self.lookahead.planned(self.step_id, verified, asks)
        return asks

    def _scheduled_step(self, plan: StepPlan, asks: dict[str, int]) -> ScheduledStep:
        """The plan and this step's block operations as the message to the executor."""
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
            kv_pulls=self.take_kv_pulls(),
        )
        if hasattr(self.block_manager, "take_state_ops"):  # recurrent layers: state slots
            self._add_state_ops(step)
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
        in the same step (see _preempt). Nor is a request alone whose rest fits this step:
        there is no one to protect, and one step plans nothing behind it at full budget. How
        many prompts prefill at once, long ones apart, is decided at admission
        (engine/sched/prefill_limits.py)."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new and not request.num_pending_forks:
            if num_new > budget or not self._alone(request):
                num_new = threshold
        return min(num_new, budget)

    def _alone(self, request: Request) -> bool:
        """Nothing but `request` is running or waiting."""
        return all(r is request for r in self.running) and all(r is request for r in self.waiting)

    @staticmethod
    def _num_unscheduled(request: Request) -> int:
        """Tokens neither computed nor scheduled: the known ones plus those being sampled."""
        in_flight = request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        if in_flight and request.num_output_tokens + in_flight >= max_tokens:
            return 0  # it finishes by length once the tokens in flight arrive
        return request.num_tokens + in_flight - request.num_computed_tokens

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

    def forget_at_executor(self, request_id: str) -> None:
        self.beams.pop_token(request_id)  # a resumed request sends all its tokens
        if request_id in self.at_executor:
            self.at_executor.discard(request_id)
            self.finished_seq_ids.append(request_id)

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
        # an import in flight is freed when its pull ends (pulled); a held prefill on release
        if not self._import_in_flight(request) and not self.hold_at_finish(request, status):
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

    def _add_state_ops(self, step: ScheduledStep) -> None:
        scheduled = step.num_scheduled_tokens
        ops = self.block_manager.take_state_ops(
            [(r, r.num_computed_tokens - scheduled[r.seq_id], scheduled[r.seq_id])
             for r in self.running if r.seq_id in scheduled]
        )  # fmt: skip
        step.state_resets, step.state_restores = ops.reset, ops.restore
        step.state_snapshots = ops.snapshots
        step.state_to_host, step.state_from_host = ops.to_host, ops.from_host
        seq_ids = [*step.num_scheduled_tokens, *(fork.child_id for fork in step.forks)]
        step.state_slots = {seq_id: self.block_manager.state_slot(seq_id) for seq_id in seq_ids}

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
