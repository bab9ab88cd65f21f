"""EngineCore: the scheduler and its step pipeline, driven the same way by both front doors.

    add(request)  ->  run_step():  schedule -> submit to the executor  (up to 1 + plan_ahead
                                   steps in flight, so step N+1 is planned while N runs)
                                   publish the deltas so far            (overlaps the executor)
                                   output of the oldest step -> update_from_output -> deltas

The executor sits behind `StepRunner`, declared here: in-process for the offline
`LLM`, over NATS for the scheduler service. Outputs leave as SampleDeltas through `publish`;
stop strings (found by whoever detokenizes) and aborts come back through `finish_early`.
"""

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvpager.engine.config import CacheConfig, EngineConfig
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.metrics import EngineMetrics
from kvpager.engine.sched.sample_deltas import SampleDeltas
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.engine.sched.stats import build_stats
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.public import ErrorInfo, Stats
from kvpager.schemas.scheduler import ExecutorReady, StepDone
from kvpager.schemas.tokenizer import SampleDelta

Publish = Callable[[list[SampleDelta], int], Awaitable[None]]
# a drained stream's final delta: "unavailable" moves it (services/tokenizer/dispatch.py)
DRAINED = ErrorInfo("unavailable", "the instance drains: the stream moves with its KV blocks")
# a prefill instance's hand-off (disaggregation): the tokenizer sends the stream on to a decode
# instance; not a failure, so not a migration either
PREFILLED = ErrorInfo("unavailable", "prompt computed: the stream goes on on a decode instance")


class StepRunner(Protocol):
    async def submit(self, step: ScheduledStep) -> None:
        """Send a step on its way; returns before it has run."""

    async def result(self, step_id: int) -> StepDone | ErrorInfo | None:
        """The step's output; an ErrorInfo if it failed (every request fails with it); None
        if it was abandoned (`cancel()`, or the executor was lost meanwhile)."""

    def cancel(self) -> None:
        """Abandon every step submitted and not yet answered."""


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        publish: Publish,
        plan_ahead: int = 1,
        check_invariants: bool = False,
        plan_ahead_with_room: bool = True,
    ) -> None:
        """`plan_ahead_with_room` False (the served scheduler): plan ahead only while the batch
        is full (requests waiting, or max_num_seqs running). With room, a request arriving
        during a step then joins the next one, not the one after, so at moderate rates it
        waits a step less for its first token. Offline every request is known up front, so planning
        ahead costs none."""
        assert plan_ahead >= 0, "plan_ahead: steps planned beyond the one the executor runs"
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = EngineMetrics()
        self.deltas = SampleDeltas(self.metrics.done, scheduler.config.vocab_size)
        self.plan_ahead = plan_ahead
        self.plan_ahead_with_room = plan_ahead_with_room
        self._publish = publish
        self._check = check_invariants
        self._in_flight: deque[tuple[ScheduledStep, bool]] = deque()  # with: back to back
        self._busy = False  # the last answered step computed something
        self.paused = False  # plan no step (a drain empties the pipeline first)
        self._absorbing = False  # a step's output is awaited or being absorbed

    # --- requests ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request, or raise a typed error (nothing is queued then)."""
        self.scheduler.add_request(request)
        self.deltas.track(request.request_id, request.sampling_params.n)
        self.metrics.added(request.request_id, request.arrival_time)

    def finish_early(
        self, request_id: str, reason: str, index: int | None = None, stop_string: str | None = None
    ) -> bool:
        """Abort every sample ("abort"), or stop the one a stop string ended ("stop").

        Frees the blocks at once, then queues a final delta per ended sample, so a final event
        always follows the freeing. False for an unknown id: it has finished, and its last
        delta is on its way.
        """
        group = list(self.scheduler.groups.get(request_id, ()))
        if reason == "stop":
            for request in group:
                if request.sample_index == index and not request.is_finished:
                    request.stop_reason = stop_string
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                    self.deltas.add_finals(request_id, "stop", [index], request=request)
        elif group:
            self.scheduler.abort(request_id)
            self.deltas.add_finals(request_id, "abort", request=group[0])
        return bool(group)

    def hand_off(
        self,
        instance: str,
        agent: str,
        movable: Callable[[Request], bool],
        why: ErrorInfo = DRAINED,
    ) -> int:
        """Drain (or a prefill instance's hand-off: `why` PREFILLED): every running stream
        that `movable` lets go ends here with a final delta carrying its KvHandoff (its
        tokenizer moves it on); its blocks stay held until the next instance read them
        (Scheduler.release). No step may be in flight."""
        assert not self.num_in_flight, "hand_off with steps in flight"
        scheduler, num_moved = self.scheduler, 0
        for request in list(scheduler.running):
            if not (movable(request) and scheduler.can_hand_off(request)):
                continue
            handoff = scheduler.hold(request, instance, agent)
            handoff.prefilled = why is PREFILLED
            self.deltas.add_finals(request.request_id, "error", error=why, kv_handoff=handoff)
            num_moved += 1
        return num_moved

    @property
    def num_in_flight(self) -> int:
        """Steps sent whose output is not absorbed yet."""
        return len(self._in_flight) + self._absorbing

    def fail_all(self, error: ErrorInfo) -> None:
        """Every open request ends with `error`; its blocks are freed."""
        for request_id in list(self.deltas.open):
            self.scheduler.abort(request_id)
        self.fail_open(error)

    def fail_open(self, error: ErrorInfo) -> None:
        """Final error deltas for every open request, without touching the scheduler (after a
        bug in it, it cannot be trusted)."""
        for request_id in list(self.deltas.open):
            self.deltas.add_finals(request_id, "error", error=error)

    def stats(self, instance: str) -> Stats:
        return build_stats(instance, self.scheduler, self.metrics)

    @property
    def has_work(self) -> bool:
        """Requests to run, finished rows to drop at the executor, or steps in flight."""
        scheduler = self.scheduler
        return scheduler.has_unfinished or bool(scheduler.finished_seq_ids or self._in_flight)

    @property
    def is_spinning(self) -> bool:
        """The last step computed nothing and nothing is in flight: wait before trying again."""
        return not (self._busy or self._in_flight or self.scheduler.finished_seq_ids)

    # --- the step pipeline -------------------------------------------------------------------

    async def run_step(self) -> bool:
        """Fill the pipeline, then absorb the oldest step's output. False: nothing in flight."""
        planned = False
        while self._may_plan():
            step = self.scheduler.schedule()
            self.metrics.scheduled(step, time.monotonic())
            await self.runner.submit(step)
            self._in_flight.append((step, self._busy or len(self._in_flight) > 0))
            await self.publish(step.step_id)  # while the executor works
            planned = True
            if not step.num_scheduled_tokens:
                break
        if not self._in_flight:
            return False
        if not planned and self.deltas.pending:
            # the pipeline drains (nothing planned while a step runs): the last step's tokens
            # go now, or they would wait out the step in flight (a first token a step late)
            await self.publish()
        step, back_to_back = self._in_flight.popleft()
        self._absorbing = True
        try:
            result = await self.runner.result(step.step_id)
            if isinstance(result, StepDone):
                self._absorb(step, result, back_to_back)
            else:
                self.abandon(result)
        finally:
            self._absorbing = False
        return True

    async def publish(self, step_id: int | None = None) -> None:
        """Hand the deltas collected so far to the front door."""
        step_id = self.scheduler.step_id if step_id is None else step_id
        await self._publish(self.deltas.take(), step_id)

    def abandon(self, error: ErrorInfo | None = None) -> None:
        """Give up on every step in flight; with `error`, fail every request too."""
        self._in_flight.clear()
        self._busy = False
        self.runner.cancel()
        if error is not None:
            self.fail_all(error)

    def _may_plan(self) -> bool:
        scheduler, in_flight = self.scheduler, self._in_flight
        if self.paused:
            return False
        if not (scheduler.has_unfinished or scheduler.finished_seq_ids):
            return False
        if not in_flight:
            return True
        if len(in_flight) >= self.plan_ahead + 1 or not scheduler.can_plan_ahead:
            return False
        return self.plan_ahead_with_room or self._is_full

    @property
    def _is_full(self) -> bool:
        """No room for a request that arrives now: it would wait whatever is planned."""
        scheduler = self.scheduler
        return bool(scheduler.waiting) or len(scheduler.running) >= scheduler.config.max_num_seqs

    def _absorb(self, step: ScheduledStep, done: StepDone, back_to_back: bool) -> None:
        output, now = done.output, time.monotonic()
        scheduler = self.scheduler
        for seq_id, chunk in output.prompt_logprobs.items():  # before the tokens they precede
            if (request := scheduler.seqs.get(seq_id)) is not None:
                self._for_one(request.request_id, self.deltas.prompt_logprobs.add, request, chunk)
        updated = scheduler.update_from_output(step, output)
        logprobs = {
            seq_id: [first, *output.extra_logprobs.get(seq_id, ())]
            for seq_id, first in zip(output.seq_ids, output.logprobs or ())
        }
        for request in updated:
            self._for_one(request.request_id, self._add_token, request, logprobs)
        for request_id, beams in scheduler.take_beam_results().items():
            self._for_one(request_id, self.deltas.add_beams, request_id, beams)
        for request_id, error in scheduler.take_failed().items():
            self.deltas.add_finals(request_id, "error", error=error)
        self._busy = bool(step.num_scheduled_tokens)
        wait_s = done.wait_s if back_to_back else None
        self.metrics.stepped(done.execute_s, wait_s, len(updated), now)
        if self._check:
            self.scheduler.check_invariants()

    def _add_token(self, request: Request, logprobs: dict) -> None:
        self.metrics.token(request.request_id, time.monotonic())
        self.deltas.add_token(request, logprobs.get(request.seq_id))

    def _for_one(self, request_id: str, handle: Callable, *args) -> None:
        """Run one request's part of the output; if it raises, that request alone fails."""
        if request_id in self.scheduler.failed:
            return
        try:
            handle(*args)
        except Exception as exc:
            self.scheduler.fail(request_id, exc)


MAX_BLOCKS = 2**24  # an executor announcing more is refused: the block lists would not fit


def check_ready(ready: ExecutorReady) -> None:
    """An executor's announcement comes over the wire: refuse sizes no executor holds."""
    sizes = {
        "num_blocks": (ready.num_blocks, 1, MAX_BLOCKS),
        "num_cpu_blocks": (ready.num_cpu_blocks, 0, MAX_BLOCKS),
        "block_size": (ready.block_size, 1, 1024),
        "max_num_seqs": (ready.max_num_seqs, 1, 65536),
        "max_model_len": (ready.max_model_len, 2, 2**24),
        "vocab_size": (ready.vocab_size, 1, 2**24),
        "world_size": (ready.world_size, 1, 1024),
        "len(kv_group_windows)": (len(ready.kv_group_windows), 0, 1024),
        "num_state_slots": (ready.num_state_slots, 0, 65536),
        "num_snapshot_slots": (ready.num_snapshot_slots, 0, MAX_BLOCKS),
        "state_slot_bytes": (ready.state_slot_bytes, 0, 2**40),
        "num_host_state_slots": (ready.num_host_state_slots, 0, 65536),
        "num_host_snapshot_slots": (ready.num_host_snapshot_slots, 0, MAX_BLOCKS),
        "kv_block_bytes": (ready.kv_block_bytes, 0, 2**40),
        "kv_budget_bytes": (ready.kv_budget_bytes, 0, 2**50),
    }
    for name, (value, low, high) in sizes.items():
        if not low <= value <= high:
            raise ConfigError(f"executor announced {name}={value}, outside [{low}, {high}]")


def build_scheduler(config: EngineConfig, ready: ExecutorReady) -> Scheduler:
    """A fresh scheduler for what the executor holds (its cache starts empty)."""
    check_ready(ready)
    cache_config = CacheConfig(
        ready.block_size,
        ready.num_blocks,
        config.enable_prefix_caching,
        ready.num_cpu_blocks,
        swap_is_cheap=ready.kv_on_host,
        enable_disk=ready.kv_disk and config.enable_prefix_caching,
        group_windows=tuple(ready.kv_group_windows),
        max_pinned_fraction=config.max_pinned_fraction,
        max_pinned_blocks_per_key=config.max_pinned_blocks_per_key,
        num_state_slots=ready.num_state_slots,
        num_snapshot_slots=ready.num_snapshot_slots,
        state_slot_bytes=ready.state_slot_bytes,
        num_host_state_slots=ready.num_host_state_slots,
        num_host_snapshot_slots=ready.num_host_snapshot_slots,
    )
    # recurrent layers: a sequence runs only with a state slot (engine/kv/state_pool.py); the
    # slots, swapped sequences and pending forks count as with max_num_seqs, so a request
    # waits for a slot and a fork or a swap-in always finds one
    max_num_seqs = min(ready.max_num_seqs, ready.num_state_slots or ready.max_num_seqs)
    limits = config.scheduler_config(max_num_seqs, ready.max_model_len, ready.vocab_size)
    return Scheduler(limits, cache_config)
