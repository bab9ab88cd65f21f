"""Tokenizer service: validates and tokenizes client requests, streams their text back.

Replicas share `llm.generate` through a queue group. Each owns the streams it accepted; the
scheduler sends their tokens to the replica's own subject (the AddRequest's `reply_to`), and
`llm.abort` reaches every replica, the owner acting on it.
"""

import asyncio
import time
import uuid

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from transformers import PreTrainedTokenizerBase

from engine.errors import KvpagerError
from schemas.public import AbortRequest, ErrorInfo, GenerateEvent, Health, ModelCard, ModelList
from schemas.scheduler import AddRequest, FinishRequest, PromptPiece, SchedulerInfo
from schemas.tokenizer import AddResult, TokenBatch
from services.settings import Settings
from services.subjects import TOKENIZER_QUEUE, Subjects
from services.tokenizer.requests import Prepared, decode_request, is_msgpack, prepare, request_id_of
from services.tokenizer.streams import Stream, error_event
from services.wire import encode_public, pack

log = structlog.get_logger(__name__)

ADD_TIMEOUT_S = 10.0
INFO_TIMEOUT_S = 2.0


def _error(exc: KvpagerError) -> ErrorInfo:
    return ErrorInfo(type=exc.type, message=str(exc), param=getattr(exc, "param", None))


class TokenizerService:
    def __init__(
        self, nc: NATS, settings: Settings, tokenizer: PreTrainedTokenizerBase, vocab_size: int
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.replica_id = uuid.uuid4().hex[:12]
        self.streams: dict[str, Stream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._public_subs: list = []

    async def start(self) -> None:
        subjects, nc = self.subjects, self.nc
        await nc.subscribe(subjects.tokens(self.replica_id), cb=self._on_tokens)
        await nc.subscribe(subjects.abort, cb=self._on_abort)
        self._public_subs = [
            await nc.subscribe(subjects.generate, queue=TOKENIZER_QUEUE, cb=self._on_generate),
            await nc.subscribe(subjects.health, queue=TOKENIZER_QUEUE, cb=self._on_health),
            await nc.subscribe(subjects.models, queue=TOKENIZER_QUEUE, cb=self._on_models),
        ]
        log.info("tokenizer ready", replica=self.replica_id, generate=subjects.generate)

    # --- requests in ------------------------------------------------------------------

    async def _on_generate(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("generate request without a reply subject: dropped")
            return
        msgpack = is_msgpack(msg.headers)
        try:
            request = decode_request(msg.data, msgpack)
            request_id = request.request_id or uuid.uuid4().hex
            prepared = prepare(request, request_id, self.tokenizer, self.vocab_size)
        except KvpagerError as exc:
            request_id = request_id_of(msg.data, msgpack)
            await self._refuse(msg.reply, msgpack, request_id, _error(exc))
            return
        refusal = self._check_admission(prepared)
        if refusal is not None:
            await self._refuse(msg.reply, msgpack, request_id, refusal, prepared)
            return
        stream = Stream(prepared, self.tokenizer, msg.reply, msgpack)
        self.streams[request_id] = stream
        if prepared.timeout_s is not None:
            self._arm(request_id, prepared.timeout_s, self._on_deadline)
        self._spawn(self._submit(stream, prepared))

    def _check_admission(self, prepared: Prepared) -> ErrorInfo | None:
        if prepared.request_id in self.streams:
            return ErrorInfo(
                "invalid_request",
                f"request_id: {prepared.request_id!r} is already in flight",
                "request_id",
            )
        if prepared.timeout_s is not None and prepared.timeout_s <= 0:
            return ErrorInfo("deadline_exceeded", "the deadline passed before arrival")
        return None

    async def _refuse(self, reply_to, msgpack, request_id, error, prepared=None) -> None:
        log.info("request refused", request_id=request_id, error=error.type, message=error.message)
        num_prompt = len(prepared.prompt_token_ids) if prepared else 0
        await self._publish_events(reply_to, msgpack, [error_event(request_id, error, num_prompt)])

    async def _submit(self, stream: Stream, prepared: Prepared) -> None:
        """Pieces of a long prompt, then the AddRequest as a NATS request."""
        ids, size = prepared.prompt_token_ids, self.settings.piece_tokens
        num_head = (len(ids) - 1) // size * size  # the AddRequest keeps the last piece
        for start in range(0, num_head, size):
            piece = PromptPiece(stream.request_id, ids[start : start + size])
            await self.nc.publish(self.subjects.scheduler_requests, pack(piece))
        add = AddRequest(
            stream.request_id,
            ids[num_head:],
            prepared.params,
            self.subjects.tokens(self.replica_id),
        )
        error = await self._request_add(add)
        if error is not None:
            await self._end(stream, error)
            return
        log.info(
            "request queued",
            request_id=stream.request_id,
            num_prompt_tokens=len(ids),
            max_tokens=prepared.params.max_tokens,
        )
        stream.submitted = True
        if stream.aborting:  # an abort or deadline that came while the add was on its way
            await self._send_finish(stream, FinishRequest(stream.request_id, "abort"))

    async def _request_add(self, add: AddRequest) -> ErrorInfo | None:
        try:
            reply = await self.nc.request(
                self.subjects.scheduler_requests, pack(add), timeout=ADD_TIMEOUT_S
            )
        except nats.errors.NoRespondersError:
            return ErrorInfo("unavailable", f"no scheduler on instance {self.settings.instance!r}")
        except nats.errors.TimeoutError:
            return ErrorInfo("unavailable", "the scheduler did not answer in time")
        return msgspec.msgpack.decode(reply.data, type=AddResult).error

    # --- aborts, deadlines, stop strings -------------------------------------------------

    async def _on_abort(self, msg: Msg) -> None:
        try:
            decoder = msgspec.msgpack if is_msgpack(msg.headers) else msgspec.json
            abort = decoder.decode(msg.data, type=AbortRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad abort request", error=str(exc))
            return
        stream = self.streams.get(abort.request_id)
        if stream is not None:  # another replica owns it otherwise
            log.info("abort", request_id=abort.request_id)
            await self._abort(stream)

    def _on_deadline(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            log.info("deadline exceeded", request_id=request_id)
            error = ErrorInfo("deadline_exceeded", "the request's deadline passed")
            self._spawn(self._abort(stream, error))

    async def _abort(self, stream: Stream, error: ErrorInfo | None = None) -> None:
        if stream.aborting:
            return
        stream.aborting = True
        stream.abort_error = error
        if stream.submitted:
            await self._send_finish(stream, FinishRequest(stream.request_id, "abort"))

    async def _send_finish(self, stream: Stream, finish: FinishRequest) -> None:
        """Tell the scheduler; if it never answers, end the stream here after a while."""
        await self.nc.publish(self.subjects.scheduler_requests, pack(finish))
        self._arm(stream.request_id, self.settings.finish_timeout, self._on_finish_timeout)

    def _on_finish_timeout(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            error = ErrorInfo("unavailable", "the scheduler did not confirm the finish")
            self._spawn(self._end(stream, error))

    # --- tokens in, events out -------------------------------------------------------------

    async def _on_tokens(self, msg: Msg) -> None:
        batch = msgspec.msgpack.decode(msg.data, type=TokenBatch)
        for delta in batch.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue  # ended here already (stop string, timeout): late tokens
            events, finish = stream.on_delta(delta)
            await self._publish_events(stream.reply_to, stream.msgpack, events)
            if finish is not None:
                await self._send_finish(stream, finish)
            if stream.done:
                self._close(stream)

    async def _end(self, stream: Stream, error: ErrorInfo) -> None:
        """End a stream without the scheduler (refused, unreachable)."""
        if self.streams.get(stream.request_id) is not stream:
            return
        events = stream.end(error)
        await self._publish_events(stream.reply_to, stream.msgpack, events)
        self._close(stream)

    def _close(self, stream: Stream) -> None:
        self.streams.pop(stream.request_id, None)
        timer = self._timers.pop(stream.request_id, None)
        if timer is not None:
            timer.cancel()
        usage = stream.usage()
        log.info(
            "request finished",
            request_id=stream.request_id,
            num_prompt_tokens=usage.num_prompt_tokens,
            num_completion_tokens=usage.num_completion_tokens,
            error=stream.error.type if stream.error else None,
        )

    async def _publish_events(self, reply_to: str, msgpack: bool, events: list[GenerateEvent]):
        for event in events:
            data, headers = encode_public(event, msgpack)
            await self.nc.publish(reply_to, data, headers=headers)

    # --- health and models -----------------------------------------------------------------

    async def _scheduler_info(self) -> SchedulerInfo | None:
        try:
            reply = await self.nc.request(self.subjects.scheduler_info, b"", timeout=INFO_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None
        return msgspec.msgpack.decode(reply.data, type=SchedulerInfo)

    async def _on_health(self, msg: Msg) -> None:
        info = await self._scheduler_info()
        if info is None:
            health = Health(
                "unavailable", self.settings.instance, self.settings.model, "no scheduler answers"
            )
        elif not info.executor_attached:
            health = Health(
                "unavailable",
                self.settings.instance,
                self.settings.model,
                "the scheduler waits for its executor",
            )
        else:
            health = Health("ok", self.settings.instance, info.model)
        await msg.respond(encode_public(health, is_msgpack(msg.headers))[0])

    async def _on_models(self, msg: Msg) -> None:
        info = await self._scheduler_info()
        models = []
        if info is not None and info.executor_attached:
            models.append(
                ModelCard(info.model, self.settings.instance, info.max_model_len, info.vocab_size)
            )
        await msg.respond(encode_public(ModelList(models), is_msgpack(msg.headers))[0])

    # --- plumbing --------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, request_id: str, delay_s: float, callback) -> None:
        old = self._timers.pop(request_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(max(delay_s, 0.0), callback, request_id)

    async def stop(self) -> None:
        """Take no new requests, let streams finish for a while, then abort the rest."""
        for sub in self._public_subs:
            await sub.unsubscribe()
        await self._wait_for_streams(self.settings.drain_timeout)
        error = ErrorInfo("unavailable", "the tokenizer is shutting down")
        for stream in list(self.streams.values()):
            await self._abort(stream, error)
        await self._wait_for_streams(min(self.settings.finish_timeout, 2.0))
        for stream in list(self.streams.values()):
            await self._end(stream, error)

    async def _wait_for_streams(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
