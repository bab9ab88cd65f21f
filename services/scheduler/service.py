"""Scheduler service: the engine core (engine/core.py) driven over NATS.

    executor attaches (capacity) -> EngineCore built for it -> loop: core.run_step()
        (steps planned ahead to the executor, its deltas routed to tokenizers meanwhile)

Everything but transport and liveness is the engine's: the step pipeline, its plan-ahead
depth, finishing and failing requests. Tokenizer messages (adds, aborts, stop-string
finishes) are handled between awaits, so they never interleave with a schedule() or an
update. When the executor is lost (PeerWatch, or a step not answered in time), every request
fails at once and the loop waits for an executor to attach; a new core is built for it.
"""

import asyncio
import time
import uuid

import msgspec
import structlog
from kvpager.engine.config import EngineConfig
from kvpager.engine.core import EngineCore, build_scheduler, check_ready
from kvpager.engine.request import Request
from kvpager.schemas.errors import ConfigError, KvpagerError
from kvpager.schemas.executor import Attached
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import (
    AddRequest,
    ExecutorReady,
    FinishRequest,
    PromptPiece,
    TokenizerMessage,
)
from kvpager.schemas.tokenizer import AddResult, SampleDelta
from kvpager.services.discovery import Discovery
from kvpager.services.liveness import repeat
from kvpager.services.pieces import Pieces
from kvpager.services.scheduler.attach import scheduler_info
from kvpager.services.scheduler.drain import KvMovesService
from kvpager.services.scheduler.kv_events import KvEventPublisher, instance_load
from kvpager.services.scheduler.link import ExecutorLink
from kvpager.services.scheduler.outbox import Outbox
from kvpager.services.scheduler.watch import PeerWatch
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects, is_inbox
from kvpager.services.wire import encode_public, pack, payload_budget, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

HOLD_CHECK_S = 5.0  # how often handed-on blocks no peer read are looked for
MAX_PIECE_TOKENS = 2**22  # prompt ids held for AddRequests still to come, at least
_tokenizer_decoder = msgspec.msgpack.Decoder(TokenizerMessage)
_ready_decoder = msgspec.msgpack.Decoder(ExecutorReady)


class SchedulerService(KvMovesService):
    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.config = EngineConfig.pick(settings)
        self.core: EngineCore | None = None
        self.executor: ExecutorReady | None = None
        self.outbox = Outbox(nc)
        self.kv_events = KvEventPublisher(
            nc, self.subjects.kv_events, settings.instance, self.scheduler_id, settings.role
        )
        # a dead tokenizer's orphaned pieces go after a while
        self._pieces = Pieces(
            ttl_s=max(30.0, 3 * settings.liveness_timeout),
            max_tokens=max(MAX_PIECE_TOKENS, 64 * settings.piece_tokens),
        )
        self._work = asyncio.Event()
        self.link = ExecutorLink(
            nc, self.subjects, settings.piece_tokens, settings.step_timeout, self._lose_executor,
            self._on_kv,
        )  # fmt: skip
        self.watch = PeerWatch(
            nc,
            self.subjects,
            settings,
            executor_id=lambda: self.executor.executor_id if self.executor else None,
            tokenizer_subjects=lambda: set(self.outbox.routes.values()),
            lose_executor=self._lose_executor,
            drop_tokenizer=self._drop_tokenizer,
        )
        self._closing = False  # refuse new requests
        self._peers_seen: dict[str, float] = {}  # other instances, when they last answered
        self._stopped = False  # no more steps
        self._requests_sub = None
        self._loop_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def start(self) -> None:
        nc, subjects = self.nc, self.subjects
        discovery = await Discovery.register(
            nc, "scheduler", self.settings, "plans steps, owns KV", stats=self._load
        )
        await discovery.subscribe("attach", subjects.scheduler_attach, self._on_attach)
        await self.link.start()
        await discovery.subscribe("info", subjects.scheduler_info, self._on_info)
        await discovery.subscribe("stats", subjects.stats, self._on_stats)
        await self.nc.subscribe(subjects.scheduler_drain, cb=self._on_drain)
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._watch_task = repeat(self.settings.heartbeat_interval, self.watch.tick)
        self._expire_task = repeat(HOLD_CHECK_S, self._expire_holds)
        self._peers_task = repeat(self.settings.heartbeat_interval, self._look_for_peers)
        log.info("scheduler waiting for its executor", attach=subjects.scheduler_attach)

    # --- the executor attaches ---------------------------------------------------------

    async def _on_attach(self, msg: Msg) -> None:
        self.watch.check_reconnect()  # drop the executor of before the reconnect first
        ready = unpack(_ready_decoder, msg.data, msg.subject)
        if ready is None:
            return
        try:
            check_ready(ready)
        except ConfigError as exc:  # no answer: that executor never attaches
            log.error("executor refused", reason=str(exc))
            return
        if self.core is not None:  # a restarted executor has lost every request's state
            self._fail_all(ErrorInfo("unavailable", "the executor restarted"))
            await self.core.publish()
        self.executor, self.core = ready, self._build_core(ready)
        # routers hear of the executor now, not at the next discovery tick: a burst sent
        # meanwhile would all go to the other instances
        await self.kv_events.publish(self.core, ready)
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

    def _build_core(self, ready: ExecutorReady) -> EngineCore:
        """A fresh core for the executor's capacity (its cache starts empty)."""
        core = EngineCore(
            build_scheduler(self.config, ready),
            self.link,
            self._publish,
            0 if self.settings.role == "prefill" else self.config.plan_ahead,  # hand on at once
            check_invariants=self.settings.check_invariants,
            plan_ahead_with_room=False,  # served: a new arrival joins the next step
        )
        self.kv_events.cleared(core)
        return core

    def _load(self) -> dict:
        """The instance's load, for discovery ($SRV.STATS endpoint data)."""
        load = instance_load(self.core, self.executor, self.settings.role)
        return msgspec.to_builtins(msgspec.structs.replace(load, closing=self._closing))

    def _lose_executor(self, error: ErrorInfo) -> None:
        """Fail every request now; the core stays (all blocks free) until an executor attaches."""
        if self.executor is None:
            return
        log.error("executor lost", executor=self.executor.executor_id, reason=error.message)
        self.executor = None
        self._fail_all(error)

    # --- requests from tokenizers ----------------------------------------------------------

    async def _on_tokenizer(self, msg: Msg) -> None:
        self.watch.check_reconnect()
        message = unpack(_tokenizer_decoder, msg.data, msg.subject)
        if message is None:
            return
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
        if (error := self._params_fit(add)) is not None:
            return error
        request = Request(
            seq_id=add.request_id,
            prompt_token_ids=token_ids,
            sampling_params=add.sampling_params,
            eos_token_ids=tuple(self.executor.eos_token_ids),
            cache_salt=add.cache_salt,
            priority=add.priority,
            pin_tokens=add.pin_tokens,
            pin_ttl=add.pin_ttl,
            kv_import=self._importable(add.kv_source),
        )
        try:
            self.core.add(request)
        except KvpagerError as exc:
            log.info("request refused", request_id=add.request_id, error=exc.type)
            return ErrorInfo(exc.type, str(exc), getattr(exc, "param", None))
        self.outbox.routes[add.request_id] = add.reply_to
        self._take_back(add.kv_source, request)
        log.debug("request added", request_id=add.request_id, num_prompt_tokens=len(token_ids))
        self._work.set()
        return None

    def _params_fit(self, add: AddRequest) -> ErrorInfo | None:
        """Each NewRequest travels whole in one message (services/fit.py cuts a step between
        them): its sampling params must leave room in the server's max_payload."""
        num_bytes, limit = len(pack(add.sampling_params)), payload_budget(self.nc) // 4
        if num_bytes <= limit:
            return None
        message = (
            f"sampling parameters: {num_bytes} bytes on the wire exceed this server's limit "
            f"({limit}: a quarter of NATS max_payload)"
        )
        param = "structured_outputs" if add.sampling_params.structured_outputs else "stop"
        return ErrorInfo("invalid_request", message, param)

    def _finish(self, finish: FinishRequest) -> None:
        if self.core is None:
            return
        if finish.kv_transfer_id:  # its stream ended before the decode side read our blocks
            self._drop_hold(finish.request_id, finish.kv_transfer_id)
            return
        core, reason = self.core, finish.finish_reason
        if core.finish_early(finish.request_id, reason, finish.index, finish.stop_reason):
            reason = finish.finish_reason
            log.info("request finished early", request_id=finish.request_id, finish_reason=reason)
            self._work.set()  # the executor must drop them, and the answer must go out

    def _drop_tokenizer(self, reply_to: str) -> None:
        """Abort the requests of a tokenizer replica that is gone: no one reads their tokens."""
        for request_id, subject in list(self.outbox.routes.items()):
            if subject == reply_to:
                self._finish(FinishRequest(request_id, "abort"))

    def _fail_all(self, error: ErrorInfo) -> None:
        """Every request fails with `error`; the steps in flight are abandoned."""
        self.core.abandon(error)
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
                await self._start_afresh()

    async def _start_afresh(self) -> None:
        """Fail every request without trusting the scheduler; the executor attaches again."""
        core, ready, self.executor = self.core, self.executor, None
        if core is None:
            return
        core.fail_open(ErrorInfo("internal_error", "the scheduler failed; see its log"))
        core.abandon()
        await core.publish()
        if ready is not None:  # a fresh core needs a fresh executor
            self.core = self._build_core(ready)

    async def _steps(self) -> None:
        while not self._stopped:
            core = self.core
            if self.executor is None or not await core.run_step():
                await self._wait_for_work(core)
                continue
            await self._hand_on_prefilled()
            if core.is_spinning:
                await self._idle_briefly()  # nothing could be scheduled: do not spin

    async def _publish(self, deltas: list[SampleDelta], step_id: int) -> None:
        """The core's deltas to their tokenizers, then the KV events and load to routers."""
        open_requests = self.core.deltas.open
        batches = self.outbox.route(deltas, is_open=open_requests.__contains__)
        for request_id in await self.outbox.publish(batches, step_id):
            self._finish(FinishRequest(request_id, "abort"))  # its stream has ended already
        await self.kv_events.publish(self.core, self.executor)

    async def _wait_for_work(self, core: EngineCore | None) -> None:
        self._work.clear()  # before the publish: work that comes during it is not missed
        if core is not None:
            await core.publish()  # final deltas, e.g. of a lost executor
        await self._work.wait()

    async def _idle_briefly(self) -> None:
        self._work.clear()
        try:
            await asyncio.wait_for(self._work.wait(), timeout=0.01)
        except TimeoutError:
            pass

    # --- queries ---------------------------------------------------------------------------

    async def _on_info(self, msg: Msg) -> None:
        self.watch.check_reconnect()  # never report an executor that is about to be dropped
        held = unfinished = 0
        if self.core is not None:
            held = len(self.core.scheduler.held)
            unfinished = self.core.scheduler.num_unfinished
        info = scheduler_info(self.scheduler_id, self.executor, held, unfinished)
        await msg.respond(pack(info))

    async def _on_stats(self, msg: Msg) -> None:
        if self.core is None or not is_inbox(msg.reply):
            return  # no answer until the executor attaches; never on a service subject
        stats = self.core.stats(self.settings.instance)
        await msg.respond(encode_public(stats, msgpack=False)[0])

    async def stop(self) -> None:
        """Refuse new requests, let running ones finish for a while, then fail the rest."""
        self._closing = True
        deadline = time.monotonic() + self.settings.drain_timeout
        await self._drain_on_stop()
        while self._busy_stopping and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.outbox.routes:
            self._fail_all(ErrorInfo("unavailable", "the scheduler is shutting down"))
        self._stopped = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._expire_task.cancel()
            self._peers_task.cancel()
        self.link.cancel()  # do not wait for a step the executor may never answer
        self._work.set()
        if self._loop_task is not None:
            await asyncio.wait({self._loop_task}, timeout=5.0)
            self._loop_task.cancel()
        if self.core is not None:
            await self.core.publish()  # the final deltas
