"""Scheduler service: engine.scheduler.Scheduler driven over NATS, one step ahead.

    executor attaches (capacity) -> Scheduler built -> loop:
        schedule() -> ScheduledStep to the executor (step N+1 while step N runs)
        publish the tokens of step N-1 to the tokenizers (while the executor runs)
        StepOutput of step N back -> update_from_output() -> deltas into the outbox

Planning ahead keeps the executor busy: step N+1 waits in its subscription when step N ends,
so the executor never waits for the scheduler's bookkeeping or a NATS round trip. Requests
that stop in step N have step N+1 computed for nothing (its token is dropped); beam searches
run one step at a time (their tokens are chosen from the step's output).

Tokenizer messages (adds, aborts, stop-string finishes) are handled between awaits, so they
never interleave with a schedule() or an update. `step_id` must come back as sent. When the
executor is lost (PeerWatch), every request fails at once and the loop waits for an executor
to attach; a new Scheduler is built for it.
"""

import asyncio
import time
import uuid
from collections import deque

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from engine.errors import KvpagerError
from engine.request import Request
from engine.scheduler import Scheduler
from schemas.executor import Attached, ScheduledStep
from schemas.public import ErrorInfo
from schemas.scheduler import (
    AddRequest,
    ExecutorReady,
    FinishRequest,
    PromptPiece,
    StepDone,
    StepFailed,
    TokenizerMessage,
)
from schemas.tokenizer import AddResult
from services.discovery import Discovery
from services.liveness import repeat
from services.scheduler.attach import build_core, scheduler_info
from services.scheduler.finishing import fail_all, fail_routes, finish_early
from services.scheduler.link import ExecutorLink
from services.scheduler.metrics import ServiceMetrics
from services.scheduler.outbox import Outbox, Route
from services.scheduler.pieces import PromptPieces
from services.scheduler.stats import build_stats
from services.scheduler.watch import PeerWatch
from services.settings import Settings
from services.subjects import Subjects
from services.wire import encode_public, pack

log = structlog.get_logger(__name__)

_tokenizer_decoder = msgspec.msgpack.Decoder(TokenizerMessage)
PLAN_AHEAD = 1  # steps planned beyond the one the executor runs


class SchedulerService:
    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.core: Scheduler | None = None
        self.executor: ExecutorReady | None = None
        self.outbox = Outbox(nc)
        self.metrics = ServiceMetrics()
        self.outbox.on_done = self.metrics.time_done
        # a dead tokenizer's orphaned pieces go after a while
        self._pieces = PromptPieces(ttl_s=max(30.0, 3 * settings.liveness_timeout))
        self._work = asyncio.Event()
        self.link = ExecutorLink(nc, self.subjects, settings.piece_tokens)
        self.watch = PeerWatch(
            nc,
            self.subjects,
            settings,
            executor_id=lambda: self.executor.executor_id if self.executor else None,
            tokenizer_subjects=lambda: {route.reply_to for route in self.outbox.routes.values()},
            lose_executor=self._lose_executor,
            drop_tokenizer=self._drop_tokenizer,
        )
        self._closing = False  # refuse new requests
        self._stopped = False  # no more steps
        self._requests_sub = None
        self._loop_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def start(self) -> None:
        nc, subjects = self.nc, self.subjects
        discovery = await Discovery.register(nc, "scheduler", self.settings, "plans steps, owns KV")
        await discovery.subscribe("attach", subjects.scheduler_attach, self._on_attach)
        await self.link.start()
        await discovery.subscribe("info", subjects.scheduler_info, self._on_info)
        await discovery.subscribe("stats", subjects.stats, self._on_stats)
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._watch_task = repeat(self.settings.heartbeat_interval, self.watch.tick)
        log.info("scheduler waiting for its executor", attach=subjects.scheduler_attach)

    # --- the executor attaches ---------------------------------------------------------

    async def _on_attach(self, msg: Msg) -> None:
        self.watch.check_reconnect()  # drop the executor of before the reconnect first
        ready = msgspec.msgpack.decode(msg.data, type=ExecutorReady)
        if self.core is not None:  # a restarted executor has lost every request's state
            self._fail_all(ErrorInfo("unavailable", "the executor restarted"))
            self.link.cancel()
        self.executor, self.core = ready, build_core(self.settings, ready)
        await msg.respond(pack(Attached(self.scheduler_id)))
        if self._requests_sub is None:  # "no responders" for tokenizers until now
            self._requests_sub = await self.nc.subscribe(
                self.subjects.scheduler_requests, cb=self._on_tokenizer
            )
        log.info(
            "executor attached",
            executor=ready.executor_id,
            num_blocks=ready.num_blocks,
            block_size=ready.block_size,
            num_cpu_blocks=ready.num_cpu_blocks,
        )
        self._work.set()

    def _lose_executor(self, error: ErrorInfo) -> None:
        """Fail every request now; the core stays (all blocks free) until an executor attaches."""
        if self.executor is None:
            return
        log.error("executor lost", executor=self.executor.executor_id, reason=error.message)
        self.executor = None
        self._fail_all(error)
        self.link.cancel()

    # --- requests from tokenizers ----------------------------------------------------------

    async def _on_tokenizer(self, msg: Msg) -> None:
        self.watch.check_reconnect()
        message = _tokenizer_decoder.decode(msg.data)
        if isinstance(message, PromptPiece):
            self._pieces.add(message.request_id, message.token_ids)
        elif isinstance(message, AddRequest):
            error = self._add(message)
            if msg.reply:
                await msg.respond(pack(AddResult(error, self.scheduler_id)))
        else:
            self._finish(message)

    def _add(self, add: AddRequest) -> ErrorInfo | None:
        token_ids = self._pieces.take(add.request_id) + add.prompt_token_ids
        if self._closing:
            return ErrorInfo("unavailable", "the scheduler is shutting down")
        if self.executor is None:
            message = "no executor is attached (it stopped or restarted); retry soon"
            return ErrorInfo("executor_unavailable", message)
        request = Request(
            request_id=add.request_id,
            prompt_token_ids=token_ids,
            sampling_params=add.sampling_params,
            eos_token_ids=tuple(self.executor.eos_token_ids),
        )
        try:
            self.core.add_request(request)
        except KvpagerError as exc:
            log.info("request refused", request_id=add.request_id, error=exc.type)
            return ErrorInfo(exc.type, str(exc), getattr(exc, "param", None))
        self.outbox.routes[add.request_id] = Route(add.reply_to, set(range(add.sampling_params.n)))
        log.debug("request added", request_id=add.request_id, num_prompt_tokens=len(token_ids))
        self._work.set()
        return None

    def _finish(self, finish: FinishRequest) -> None:
        if finish_early(self.core, self.outbox, finish):
            reason = finish.finish_reason
            log.info("request finished early", request_id=finish.request_id, finish_reason=reason)
            self._work.set()  # the executor must drop them, and the answer must go out

    def _drop_tokenizer(self, reply_to: str) -> None:
        """Abort the requests of a tokenizer replica that is gone: no one reads their tokens."""
        for request_id, route in list(self.outbox.routes.items()):
            if route.reply_to == reply_to:
                self._finish(FinishRequest(request_id, "abort"))

    def _fail_all(self, error: ErrorInfo) -> None:
        fail_all(self.core, self.outbox, error)
        log.error("failed every request", error=error.type, message=error.message)
        self._work.set()

    # --- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        """The loop, restarted after a bug: requests fail, nothing hangs."""
        while not self._stopped:
            try:
                await self._steps()
            except Exception:
                log.exception("scheduler loop failed: failing every request")
                self._start_afresh()

    def _start_afresh(self) -> None:
        """Fail every request without trusting the core; the executor attaches again."""
        fail_routes(self.outbox, ErrorInfo("internal_error", "the scheduler failed; see its log"))
        ready, self.executor = self.executor, None  # a fresh core needs a fresh executor
        if ready is not None:
            self.core = build_core(self.settings, ready)
        self.link.cancel()

    async def _steps(self) -> None:
        in_flight: deque[tuple[ScheduledStep, bool]] = deque()  # with: planned back to back
        busy = False  # the last answered step computed something
        while not self._stopped:
            core = self.core
            if self.executor is not None and self._may_plan(core, in_flight):
                step = core.schedule()
                self.metrics.time_scheduled(step, self.outbox.routes, time.monotonic())
                await self.link.send(step)
                in_flight.append((step, busy or len(in_flight) > 0))
                await self.outbox.flush(step.step_id)  # overlaps the executor's work
                if step.num_scheduled_tokens and self._may_plan(core, in_flight):
                    continue  # plan the next step while this one runs
            if self.executor is None or not in_flight:
                in_flight.clear()
                await self._wait_for_work(core)
                busy = False
                continue
            step, back_to_back = in_flight.popleft()
            done = await self._answer(core, step)
            if done is None:  # abandoned: every request failed, or the executor re-attached
                in_flight.clear()
                self.link.cancel()
                busy = False
                continue
            self._absorb(step, done, back_to_back)
            busy = bool(step.num_scheduled_tokens)
            if not (busy or in_flight or core.finished_req_ids):
                await self._idle_briefly()  # nothing could be scheduled: do not spin

    @staticmethod
    def _may_plan(core: Scheduler, in_flight: deque) -> bool:
        if not (core.has_unfinished or core.finished_req_ids):
            return False
        return not in_flight or (len(in_flight) < PLAN_AHEAD + 1 and core.can_plan_ahead)

    async def _wait_for_work(self, core: Scheduler | None) -> None:
        self._work.clear()  # before the flush: work that comes during it is not missed
        if core is not None:
            await self.outbox.flush(core.step_id)  # final deltas, e.g. of a lost executor
        await self._work.wait()

    async def _idle_briefly(self) -> None:
        self._work.clear()
        try:
            await asyncio.wait_for(self._work.wait(), timeout=0.01)
        except asyncio.TimeoutError:
            pass

    async def _answer(self, core: Scheduler, step: ScheduledStep) -> StepDone | None:
        """The executor's answer to a sent step; None if the step is abandoned."""
        answer = await self.link.answer(step.step_id, self.settings.step_timeout)
        if self.core is not core or self.executor is None or self._stopped:
            return None  # re-attached, executor lost or stopping: step abandoned
        if answer is None:
            timeout = self.settings.step_timeout
            message = f"the executor did not answer step {step.step_id} in {timeout} s"
            self._lose_executor(ErrorInfo("executor_unavailable", message))
        elif isinstance(answer, StepFailed):
            message = f"the executor failed step {answer.step_id}: {answer.message}"
            self._fail_all(ErrorInfo("internal_error", message))
        return answer if isinstance(answer, StepDone) else None

    def _absorb(self, step: ScheduledStep, done: StepDone, back_to_back: bool) -> None:
        now, output, metrics = time.monotonic(), done.output, self.metrics
        metrics.step.add(done.execute_s)
        if back_to_back:
            metrics.executor_wait.add(done.wait_s)
        updated = self.core.update_from_output(step, output)
        logprobs = dict(zip(output.req_ids, output.logprobs or ()))
        for request in updated:
            route = self.outbox.add_token(request, logprobs.get(request.request_id))
            if route is not None:
                metrics.time_token(route, now)
        for group_id, beams in self.core.take_beam_results().items():
            self.outbox.add_beams(group_id, beams, num_cached_tokens=0)
        metrics.throughput.add(len(updated), now)
        if self.settings.check_invariants:
            self.core.check_invariants()

    # --- queries ---------------------------------------------------------------------------

    async def _on_info(self, msg: Msg) -> None:
        self.watch.check_reconnect()  # never report an executor that is about to be dropped
        await msg.respond(pack(scheduler_info(self.scheduler_id, self.executor)))

    async def _on_stats(self, msg: Msg) -> None:
        if self.core is None:
            return  # no answer until the executor attaches: the client times out
        stats = build_stats(self.settings.instance, self.core, self.metrics)
        await msg.respond(encode_public(stats, msgpack=False)[0])

    async def stop(self) -> None:
        """Refuse new requests, let running ones finish for a while, then fail the rest."""
        self._closing = True
        deadline = time.monotonic() + self.settings.drain_timeout
        while self.outbox.routes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.outbox.routes:
            self._fail_all(ErrorInfo("unavailable", "the scheduler is shutting down"))
        self._stopped = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        self.link.cancel()  # do not wait for a step the executor may never answer
        self._work.set()
        if self._loop_task is not None:
            await asyncio.wait({self._loop_task}, timeout=5.0)
            self._loop_task.cancel()
        if self.core is not None:
            await self.outbox.flush(self.core.step_id)  # the final deltas
