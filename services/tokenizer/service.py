"""Tokenizer service: validates and tokenizes client requests, streams their text back.

Replicas share `llm.generate` through a queue group. Each owns the streams it accepted and
routes each to an instance (scheduler + executor pair) its router picks (services/tokenizer/
instances.py, engine/router/routing.py); the scheduler sends their tokens to the replica's own
subject under that instance (the AddRequest's `reply_to`), and `llm.abort` reaches every
replica, the owner acting on it.
"""

import asyncio
import time
import uuid

import msgspec
import nats.errors
import structlog
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.schemas.public import AbortRequest, ErrorInfo, GenerateEvent
from kvpager.schemas.scheduler import FinishRequest
from kvpager.schemas.tokenizer import SampleDelta, TokenBatch
from kvpager.services.discovery import Discovery
from kvpager.services.inflight import Journal, request_key
from kvpager.services.liveness import repeat
from kvpager.services.settings import Settings
from kvpager.services.subjects import TOKENIZER_QUEUE, Subjects, is_inbox
from kvpager.services.tokenizer import info, tokenize
from kvpager.services.tokenizer.dispatch import Dispatch, movable, typed_error
from kvpager.services.tokenizer.instances import Instances
from kvpager.services.tokenizer.limits import RequestLimits
from kvpager.services.tokenizer.requests import (
    admission_error,
    is_msgpack,
    prepare_body,
    request_id_of,
)
from kvpager.services.tokenizer.streams import Stream, error_event, over_the_limit
from kvpager.services.tokenizer.watch import StreamWatch
from kvpager.services.wire import encode_public, pack, payload_budget, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from transformers import PreTrainedTokenizerBase

log = structlog.get_logger(__name__)
_batch_decoder = msgspec.msgpack.Decoder(TokenBatch)


class TokenizerService:
    def __init__(
        self, nc: NATS, settings: Settings, tokenizer: PreTrainedTokenizerBase, vocab_size: int
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.tokenizer = tokenizer
        self.inputs = InputProcessor(
            tokenizer,
            vocab_size,
            allow_special_tokens_in_content=settings.allow_special_tokens_in_content,
            grammar_limits=settings.grammar_limits,
            compile_workers=True,
        )
        self.limits = RequestLimits.from_settings(settings)
        self.replica_id = uuid.uuid4().hex[:12]
        self.streams: dict[str, Stream] = {}
        self.journal = Journal(settings.journal_dir)  # what serve reads if we crash
        self.instances = Instances(nc, settings)
        self.dispatch = Dispatch(
            nc,
            settings,
            self.instances,
            self.replica_id,
            self.streams,
            end=self._end,
            lose=self._lose,
            send_finish=self._send_finish,
            spawn=self._spawn,
        )
        self.watch = StreamWatch(
            nc, self.subjects, settings, self.streams, lose=self._lose, move=self.dispatch.move
        )
        self._tasks: set[asyncio.Task] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._discovery: Discovery | None = None
        self._watch_task: asyncio.Task | None = None
        self._discover_task: asyncio.Task | None = None

    async def start(self) -> None:
        subjects, nc = self.subjects, self.nc
        await nc.subscribe(subjects.all_tokens(self.replica_id), cb=self._on_tokens)
        await nc.subscribe(subjects.abort, cb=self._on_abort)
        await self.instances.start()
        self._discovery = discovery = await Discovery.register(
            nc, "tokenizer", self.settings, "validates, tokenizes, streams text back"
        )
        await discovery.subscribe("generate", subjects.generate, self._on_generate, TOKENIZER_QUEUE)
        await discovery.subscribe("health", subjects.health, self._on_health, TOKENIZER_QUEUE)
        await discovery.subscribe("models", subjects.models, self._on_models, TOKENIZER_QUEUE)
        for name, answer in (("tokenize", tokenize.tokenize), ("detokenize", tokenize.detokenize)):
            handler = self._query_handler(answer)
            await discovery.subscribe(name, getattr(subjects, name), handler, TOKENIZER_QUEUE)
        self._watch_task = repeat(self.settings.heartbeat_interval, self.watch.tick)
        self._discover_task = repeat(self.settings.heartbeat_interval, self.instances.discover)
        log.info("tokenizer ready", replica=self.replica_id, generate=subjects.generate)

    # --- requests in ------------------------------------------------------------------

    async def _on_generate(self, msg: Msg) -> None:
        if not is_inbox(msg.reply):
            log.warning("generate request without an inbox reply subject: dropped")
            return
        # A reconnect not yet noticed ends the streams it may have cut, before this one joins
        # them (it came after the reconnect, so it lost nothing).
        await self.watch.check_reconnect()
        msgpack = is_msgpack(msg.headers)
        try:
            key = request_key(msg.data, msgpack, self.limits.max_request_bytes)
            with self.journal.admitting(key):  # a crash in here blames the request
                prepared = await prepare_body(msg.data, msgpack, self.inputs, self.limits)
        except Exception as exc:  # a bug too gets an error event, never silence
            request_id = request_id_of(msg.data, msgpack, self.limits.max_request_bytes)
            await self._refuse(msg.reply, msgpack, request_id, typed_error(exc))
            return
        refusal = admission_error(prepared, in_flight=prepared.request_id in self.streams)
        if refusal is not None:
            await self._refuse(msg.reply, msgpack, prepared.request_id, refusal, prepared)
            return
        stream = Stream(prepared, self.tokenizer, msg.reply, msgpack, payload_budget(self.nc))
        self.streams[prepared.request_id] = stream
        self.journal.stream_opened(prepared.request_id, msg.reply, msgpack)
        if prepared.timeout_s is not None:
            self._arm(prepared.request_id, prepared.timeout_s, self._on_deadline)
        self._spawn(self.dispatch.route(stream, prepared.prompt_token_ids, prepared.params))

    async def _refuse(self, reply_to, msgpack, request_id, error, prepared=None) -> None:
        log.info("request refused", request_id=request_id, error=error.type, message=error.message)
        num_prompt = len(prepared.prompt_token_ids) if prepared else 0
        await self._publish_events(reply_to, msgpack, [error_event(request_id, error, num_prompt)])

    # --- aborts, deadlines, stop strings -------------------------------------------------

    async def _on_abort(self, msg: Msg) -> None:
        if len(msg.data) > self.limits.max_request_bytes:
            log.warning("oversized abort request dropped", num_bytes=len(msg.data))
            return
        try:
            decoder = msgspec.msgpack if is_msgpack(msg.headers) else msgspec.json
            abort = decoder.decode(msg.data, type=AbortRequest)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            log.warning("bad abort request", error=str(exc))
            return
        stream = self.streams.get(abort.request_id)
        if stream is None:  # another replica owns it, or it ended
            return
        if not stream.may_abort(abort.abort_token):
            log.warning("abort refused: not the stream's token", request_id=abort.request_id)
            return
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
        if stream.kv_held is not None:  # handed on: the decode side may not have read it yet
            await self.dispatch.drop_hold(stream, stream.kv_held)
        if stream.submitted:
            await self._send_finish(stream, FinishRequest(stream.request_id, "abort"))

    async def _send_finish(self, stream: Stream, finish: FinishRequest) -> None:
        """Tell the scheduler; if it never answers, end the stream here after a while."""
        await self.nc.publish(self.dispatch.requests_subject(stream), pack(finish))
        self._arm(stream.request_id, self.settings.finish_timeout, self._on_finish_timeout)

    def _on_finish_timeout(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            error = ErrorInfo("unavailable", "the scheduler did not confirm the finish")
            self._spawn(self._end(stream, error))

    # --- tokens in, events out -------------------------------------------------------------

    async def _on_tokens(self, msg: Msg) -> None:
        if msg.reply and not msg.data:  # the scheduler's liveness ping
            await msg.respond(b"")
            return
        await self.watch.check_reconnect()  # batches before this one may be lost
        batch = unpack(_batch_decoder, msg.data, msg.subject)
        if batch is None:
            return
        instance = msg.subject.rsplit(".", 3)[1]  # <prefix>.internal.<instance>.tokens.<id>
        for delta in batch.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None or stream.instance != instance:
                continue  # ended here already (stop string, timeout), or moved: late tokens
            try:
                await self._on_delta(stream, delta)
            except Exception as exc:  # a bug in one stream must not hang it, nor the others
                log.exception("stream failed", request_id=stream.request_id)
                await self._lose(stream, ErrorInfo("internal_error", f"the stream failed: {exc!r}"))

    async def _on_delta(self, stream: Stream, delta: SampleDelta) -> None:
        moves = delta.kv_handoff is not None or (delta.error is not None and movable(delta.error))
        if moves and not stream.submitted and not await self.dispatch.answered(stream):
            return  # the add failed or went elsewhere meanwhile: its route goes on
        if delta.kv_handoff is not None and delta.kv_handoff.prefilled:  # disaggregation
            if not (stream.aborting or stream.stopping):
                await self.dispatch.hand_on(stream, delta.kv_handoff)
                return
            # aborted meanwhile, or a stop string in its first token: it ends here, and the
            # prefill instance frees the blocks it held for the decode side at once
            await self.dispatch.drop_hold(stream, delta.kv_handoff)
            reason = "abort" if stream.aborting else "stop"
            delta = msgspec.structs.replace(
                delta, finish_reason=reason, error=None, kv_handoff=None
            )
        if delta.error is not None and movable(delta.error):
            # the instance failed or drains, not the request; a drain hands on its blocks
            await self.dispatch.move(stream, delta.error, delta.kv_handoff)
            return
        events, finish = stream.on_delta(delta)
        await self._send(stream, events)
        if finish is not None:
            await self._send_finish(stream, finish)
        if stream.done:
            self._close(stream)

    async def _end(self, stream: Stream, error: ErrorInfo) -> None:
        """End a stream without the scheduler (refused, unreachable)."""
        if self.streams.get(stream.request_id) is not stream:
            return
        await self._send(stream, stream.end(error))
        self._close(stream)

    async def _lose(self, stream: Stream, error: ErrorInfo) -> None:
        """End a stream here, and ask the scheduler (if it still runs it) to drop it too."""
        if self.streams.get(stream.request_id) is not stream:
            return
        if stream.submitted:
            finish = FinishRequest(stream.request_id, "abort")
            await self.nc.publish(self.dispatch.requests_subject(stream), pack(finish))
        await self._end(stream, error)

    def _close(self, stream: Stream) -> None:
        self.streams.pop(stream.request_id, None)
        self.journal.stream_closed(stream.request_id)
        self.instances.router.release(stream.request_id)
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

    async def _send(self, stream: Stream, events: list[GenerateEvent]) -> None:
        if events:
            stream.last_sent_at = time.monotonic()
        await self._publish_events(stream.reply_to, stream.msgpack, events)

    async def _publish_events(self, reply_to: str, msgpack: bool, events: list[GenerateEvent]):
        for event in events:
            data, headers = encode_public(event, msgpack)
            try:
                await self.nc.publish(reply_to, data, headers=headers)
            except nats.errors.MaxPayloadError:  # the stream still ends, with a typed error
                log.error("event over the wire's limit", request_id=event.request_id)
                data, headers = encode_public(over_the_limit(event, len(data)), msgpack)
                await self.nc.publish(reply_to, data, headers=headers)

    # --- health and models -----------------------------------------------------------------

    async def _on_health(self, msg: Msg) -> None:
        await self._answer(msg, info.health)

    async def _on_models(self, msg: Msg) -> None:
        await self._answer(msg, info.models)

    def _query_handler(self, answer):
        async def handle(msg: Msg) -> None:
            if is_inbox(msg.reply):  # answers go to inboxes only (see _answer)
                await msg.respond(answer(msg.data, msg.headers, self.inputs, self.limits))

        return handle

    async def _answer(self, msg: Msg, build) -> None:
        if not is_inbox(msg.reply):
            return  # a request or a publish aimed at a service subject: no answer
        serving = [i.name for i in self.instances.router.instances.values() if i.load.model]
        instance = min(serving, default=self.settings.instance)
        state = await info.scheduler_info(
            self.nc, self.subjects.for_instance(instance).scheduler_info
        )
        await msg.respond(encode_public(build(state, self.settings), is_msgpack(msg.headers))[0])

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
        if self._discovery is not None:  # its endpoints are the public subscriptions
            await self._discovery.stop()
        await self._wait_for_streams(self.settings.drain_timeout)
        for task in (self._watch_task, self._discover_task):
            if task is not None:
                task.cancel()
        error = ErrorInfo("unavailable", "the tokenizer is shutting down")
        for stream in list(self.streams.values()):
            await self._abort(stream, error)
        await self._wait_for_streams(min(self.settings.finish_timeout, 2.0))
        for stream in list(self.streams.values()):
            await self._end(stream, error)
        self.inputs.close()

    async def _wait_for_streams(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
