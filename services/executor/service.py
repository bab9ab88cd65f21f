"""Executor service: engine.worker.executor.Executor fed ScheduledSteps over NATS.

It announces its capacity until a scheduler answers, then runs each step it receives, in
order, and returns the sampled tokens with its own timings. All tensors stay here; the steps
carry ids only. Steps run on the InProcessExecutor's thread (the offline LLM's own), so the
event loop keeps answering the scheduler's liveness pings during a long step; a step goes to
that thread as it arrives and is answered from a task, in order, so a step planned ahead
starts as the last one ends.

When its scheduler is gone, restarted or has dropped it (or our NATS connection was
interrupted, so a step may be lost), the executor forgets every request, takes a new id (the
old scheduler's pings then find no one and it fails its requests at once) and attaches again.
"""

import asyncio
import os
import time
import uuid

import msgspec
import nats.errors
import structlog
from kvpager.engine.config import EngineConfig
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.worker.executor import Executor
from kvpager.engine.worker.step_runner import InProcessExecutor
from kvpager.engine.worker.tensor_parallel import build_executor
from kvpager.kernels.openmp import serial_pool
from kvpager.schemas.errors import ExecutorUnavailableError, InvalidStepError
from kvpager.schemas.executor import (
    Attached,
    NewRequest,
    RunStep,
    ScheduledStep,
    SchedulerMessage,
    StepPiece,
    StepRequests,
)
from kvpager.schemas.kv_transfer import KvPulled, KvSent
from kvpager.schemas.scheduler import ExecutorReady, SchedulerInfo, StepDone, StepFailed
from kvpager.services.connection import flush_sent
from kvpager.services.discovery import Discovery
from kvpager.services.executor.kv_endpoint import KvEndpoint, make_transfer
from kvpager.services.fit import split_done
from kvpager.services.liveness import PeerGone, Reconnects, ping, repeat
from kvpager.services.pieces import Pieces
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack, payload_budget, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

ATTACH_TIMEOUT_S = 2.0
EXIT_RANK_LOST = 3
IDLE_BEFORE_EXIT_S = 0.5
_decoder = msgspec.msgpack.Decoder(SchedulerMessage)


def load_executor(settings: Settings) -> Executor:
    path = settings.model_path()
    model_config = ModelConfig.from_path(path)
    config = EngineConfig.pick(settings).executor_config(path, model_config)
    return build_executor(config, model_config)


class ExecutorService:
    def __init__(
        self,
        nc: NATS,
        settings: Settings,
        runner: InProcessExecutor,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.runner = runner
        self.executor = runner.executor
        self.executor_id = uuid.uuid4().hex[:12]
        self.scheduler_id: str | None = None  # attached to it
        self._attaching = False
        config = self.executor.config  # pieces of more than one step's rows are refused
        self._pieces = Pieces(settings.step_timeout, config.max_num_seqs * config.max_model_len)
        self._ahead: list[NewRequest] = []  # StepRequests of the next step
        self._last_step_id: int | None = None
        self._stopped = False  # the step thread is gone: steps are refused
        self._last_activity = 0.0
        self._lock = asyncio.Lock()  # a step and a reset never overlap
        self._answering: asyncio.Task | None = None  # the last step handed on, till answered
        self._reconnects = Reconnects(nc)
        self._ping_sub = None
        self._watch_task: asyncio.Task | None = None
        transfer = make_transfer(self.executor, settings, nc)
        self.kv = KvEndpoint(nc, settings, transfer, self._to_scheduler) if transfer else None

    async def start(self) -> None:
        # to_thread's workers (KV gathers and scatters) stay serial: kernels/openmp.py
        asyncio.get_running_loop().set_default_executor(serial_pool(None, "kvpager-io"))
        await self._watch_ranks()
        if self.kv is not None:
            await self.kv.start()
        discovery = await Discovery.register(
            self.nc, "executor", self.settings, "runs the model on the paged KV cache"
        )
        await discovery.subscribe("steps", self.subjects.executor_steps, self._on_message)
        await self._answer_pings()
        self._watch_task = repeat(self.settings.heartbeat_interval, self._tick)

    async def _watch_ranks(self) -> None:
        """Tensor parallel: a rank lost while idle makes us leave at once."""
        ranks = self.executor.ranks
        if ranks is None:
            return
        loop = asyncio.get_running_loop()
        ranks.on_lost = lambda reason: loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._exit_lost(reason))
        )
        if ranks.lost is not None:
            await self._exit_lost(ranks.lost)

    async def _answer_pings(self) -> None:
        async def pong(msg: Msg) -> None:
            await msg.respond(b"")

        if self._ping_sub is not None:
            await self._ping_sub.unsubscribe()
        subject = self.subjects.executor_ping(self.executor_id)
        self._ping_sub = await self.nc.subscribe(subject, cb=pong)

    def ready_message(self) -> ExecutorReady:
        ready = self.executor.ready(self.executor_id, self.settings.model)
        if self.kv is None:
            return ready
        return msgspec.structs.replace(ready, kv_agent=self.kv.name)

    async def _to_scheduler(self, message: KvPulled | KvSent) -> None:
        await self.nc.publish(self.subjects.scheduler_outputs, pack(message))

    # --- attaching, and watching the scheduler ---------------------------------------------

    async def _tick(self) -> None:
        await self._check_reconnect()
        if self.scheduler_id is None:
            await self._attach()
        else:
            await self._check_scheduler()

    async def _check_reconnect(self) -> None:
        if self._reconnects.take():  # a step or its answer may be lost: start afresh
            await self._detach("the connection to NATS was interrupted")

    async def _attach(self) -> None:
        """Ask to attach (a scheduler may start before or after us); steps follow the answer."""
        self._attaching = True  # the first step may come before the answer is read
        try:
            reply = await self.nc.request(
                self.subjects.scheduler_attach, pack(self.ready_message()), timeout=ATTACH_TIMEOUT_S
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return
        finally:
            self._attaching = False
        self.scheduler_id = msgspec.msgpack.decode(reply.data, type=Attached).scheduler_id
        if self.kv is not None:
            await self.kv.announce()
        log.info(
            "attached to scheduler",
            scheduler=self.scheduler_id,
            executor=self.executor_id,
            num_blocks=self.executor.num_blocks,
        )

    async def _check_scheduler(self) -> None:
        try:
            reply = await ping(
                self.nc, self.subjects.scheduler_info, self.settings.heartbeat_interval
            )
        except PeerGone:
            await self._detach("the scheduler stopped")
            return
        if reply is None:
            return  # busy, or NATS is down: the reconnect check covers the latter
        info = msgspec.msgpack.decode(reply.data, type=SchedulerInfo)
        if (info.scheduler_id, info.executor_id) != (self.scheduler_id, self.executor_id):
            await self._detach("the scheduler restarted or dropped this executor")

    async def _detach(self, reason: str) -> None:
        log.warning("detached from the scheduler", reason=reason, scheduler=self.scheduler_id)
        self.scheduler_id = None
        async with self._lock:
            await self._steps_answered()
            try:
                self.executor.reset()
            except ExecutorUnavailableError as exc:
                await self._exit_lost(str(exc))
            self._pieces.clear()
            self._ahead = []
            self._last_step_id = None
        self.executor_id = uuid.uuid4().hex[:12]
        await self._answer_pings()

    # --- steps ---------------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        self._last_activity = time.monotonic()
        await self._check_reconnect()
        if self.scheduler_id is None and not self._attaching:
            log.warning("step from a scheduler this executor is not attached to: dropped")
            return
        # undecodable: no step id to answer; the scheduler's step timeout covers such a loss
        message = unpack(_decoder, msg.data, msg.subject)
        if isinstance(message, StepPiece):
            self._pieces.add(message.seq_id, message.token_ids)
        elif isinstance(message, StepRequests):
            self._hold(message.new_requests)
        elif isinstance(message, RunStep):
            async with self._lock:
                await self._start_step(message.step)

    async def _start_step(self, step: ScheduledStep) -> None:
        """Hand the step to the step thread now and answer it later, in order (_finish_step):
        the scheduler plans a step ahead (engine/core.py), so the step thread goes on to it
        from the last without a round through this loop. Steps run in order: an out-of-order
        one is refused and the order kept, so one stray or replayed step cannot move the
        executor's count."""
        if self._stopped:  # past stop(): the step thread is gone
            await self._fail_in_order(
                step.step_id, "the executor is shutting down", "executor_unavailable"
            )
            return
        expected = None if self._last_step_id is None else self._last_step_id + 1
        if expected is not None and step.step_id != expected:
            self._pieces.clear()
            self._ahead = []
            message = f"got step {step.step_id}, expected {expected}"
            await self._fail_in_order(step.step_id, message, "invalid_step")
            return
        self._last_step_id = step.step_id
        await self.runner.submit(self._with_pieces(step))
        self._answering = asyncio.create_task(self._finish_step(step, self._answering))

    async def _steps_answered(self) -> None:
        """Wait until every step handed on has been answered (or failed to be)."""
        if self._answering is not None:
            await asyncio.wait({self._answering})

    async def _fail_in_order(self, step_id: int, message: str, error_type: str) -> None:
        await self._steps_answered()  # the answers of the steps before it go first
        await self._fail(step_id, message, error_type)

    async def _finish_step(self, step: ScheduledStep, before: asyncio.Task | None) -> None:
        """Answer the step once the step before it was answered. A failure to answer ends
        this step alone: it is logged, and the scheduler's step timeout covers the loss."""
        if before is not None:
            await asyncio.wait({before})
        try:
            await self._answer_step(step)
        except Exception:
            log.exception("answering a step failed", step_id=step.step_id)

    async def _answer_step(self, step: ScheduledStep) -> None:
        try:
            done = await self.runner.result(step.step_id)
        except ExecutorUnavailableError as exc:  # its requests fail now, then we go
            await self._fail(step.step_id, str(exc), exc.type)
            await self._exit_lost(str(exc))
            return
        except InvalidStepError as exc:  # refused whole: nothing of it was applied
            await self._fail(step.step_id, str(exc), exc.type)
            return
        except Exception as exc:  # a bug: answer so the scheduler fails the requests, not hangs
            log.exception("step failed", step_id=step.step_id)
            await self._fail(step.step_id, repr(exc))
            return
        await self._answer(done)
        if step.kv_pulls and self.kv is not None:  # after the step's swap-outs ran
            self.kv.start_pulls(step.kv_pulls)
        elif step.kv_pulls:
            for pull in step.kv_pulls:
                await self._to_scheduler(KvPulled(pull.transfer_id, error="no KV transfer"))
        self._last_activity = time.monotonic()

    async def _answer(self, done: StepDone) -> None:
        """The step's output, its large per-sequence parts ahead when it would not fit in one
        message. Should a publish still fail, the step fails at once: the scheduler never
        waits for its step timeout."""
        subject = self.subjects.scheduler_outputs
        parts, done = split_done(done, payload_budget(self.nc))
        try:
            for part in parts:
                await self.nc.publish(subject, pack(part))
            await self.nc.publish(subject, pack(done))
        except nats.errors.MaxPayloadError as exc:
            step_id = done.output.step_id
            await self._fail(step_id, f"step {step_id}'s output is over the wire's limit: {exc}")

    def _hold(self, new_requests: list[NewRequest]) -> None:
        """Keep the next step's leading new requests, bounded like the pieces (a step holds at
        most max_num_seqs rows)."""
        if len(self._ahead) + len(new_requests) > self.executor.config.max_num_seqs:
            log.error("new requests sent ahead beyond max_num_seqs: dropped")
            self._ahead = []
            return
        self._ahead += new_requests

    def _with_pieces(self, step: ScheduledStep) -> ScheduledStep:
        """Put the new requests and token ids sent ahead (StepRequests, StepPieces) back in
        front of the step's own."""
        if self._ahead:
            ahead, self._ahead = self._ahead, []
            step = msgspec.structs.replace(step, new_requests=ahead + step.new_requests)
        if not self._pieces:
            return step
        new_requests = [
            msgspec.structs.replace(new, token_ids=self._pieces.take(new.seq_id) + new.token_ids)
            for new in step.new_requests
        ]
        self._pieces.clear()  # pieces of no request in this step: stray, never used
        return msgspec.structs.replace(step, new_requests=new_requests)

    async def _fail(self, step_id: int, message: str, error_type: str = "internal_error") -> None:
        log.error("step failed", step_id=step_id, message=message)
        failed = StepFailed(step_id, message, error_type)
        await self.nc.publish(self.subjects.scheduler_outputs, pack(failed))

    async def _needed(self) -> bool:
        """Pulls in flight, or a scheduler with requests to finish or blocks held for peers
        to read (a drain's handoffs): steps may still come, or peers read the blocks from
        us. A scheduler that answers with an error is up, and may still need us."""
        if self.kv is not None and self.kv.busy:
            return True
        try:
            reply = await ping(self.nc, self.subjects.scheduler_info, 0.5)
        except PeerGone:
            return False
        if reply is None:  # up but busy: the deadline bounds the wait
            return True
        try:
            info = msgspec.msgpack.decode(reply.data, type=SchedulerInfo)
        except msgspec.DecodeError:
            log.warning("bad scheduler info at stop", headers=reply.headers)
            return True
        return info.num_kv_held > 0 or info.num_unfinished > 0

    async def _exit_lost(self, reason: str) -> None:
        """A tensor-parallel rank is gone: no step can run again. Exit now (the ranks started
        here die with us); the scheduler finds us gone and a supervisor may restart us."""
        log.error("executor exits: a tensor-parallel rank was lost", reason=reason)
        try:
            await asyncio.wait_for(flush_sent(self.nc), 2.0)
        except (TimeoutError, nats.errors.Error):
            pass
        os._exit(EXIT_RANK_LOST)

    async def stop(self) -> None:
        """Keep serving while steps still come (the scheduler finishing), then stop."""
        if self._watch_task is not None:
            self._watch_task.cancel()
        deadline = time.monotonic() + self.settings.drain_timeout + 5.0
        while time.monotonic() < deadline:
            idle = time.monotonic() - self._last_activity > IDLE_BEFORE_EXIT_S
            if idle and not await self._needed():
                break
            await asyncio.sleep(0.1)
        if self.kv is not None:
            self.kv.close()
        async with self._lock:  # tensor parallel: the other ranks exit too
            await self._steps_answered()
            self._stopped = True
            await asyncio.get_running_loop().run_in_executor(None, self.runner.close)
