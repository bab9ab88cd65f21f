"""Where a tokenizer's streams run: each request routed to an instance and sent there (again
elsewhere when that instance is gone), and moved when its instance fails mid-stream.

Migration: the stream's request goes on on another instance as a continuation (the tokens
so far appended to the prompt; engine/frontend/migration.py), at most `--migration-limit`
times, then the stream ends with `migration_failed`. With no other instance up it ends with the
error that made it move, as it would with one instance. Deltas from the instance it left are
dropped by their subject (the tokenizer checks `stream.instance`).
"""

import asyncio
from collections.abc import Awaitable, Callable, Coroutine

import msgspec
import nats.errors
import structlog
from kvpager.schemas.errors import KvpagerError, ModelNotFoundError, NoInstanceError
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import AddRequest, FinishRequest, PromptPiece
from kvpager.schemas.tokenizer import AddResult
from kvpager.services.pieces import split
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.tokenizer.instances import Instances
from kvpager.services.tokenizer.streams import Stream
from kvpager.services.wire import pack, payload_budget
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)

ADD_TIMEOUT_S = 10.0
# A final delta or an AddResult with these means the instance failed the request (its
# executor or scheduler went): the stream moves to another instance.
MOVABLE_ERRORS = ("executor_unavailable", "unavailable")

EndStream = Callable[[Stream, ErrorInfo], Awaitable[None]]
SendFinish = Callable[[Stream, FinishRequest], Awaitable[None]]


def movable(error: ErrorInfo) -> bool:
    return error.type in MOVABLE_ERRORS


def typed_error(exc: Exception) -> ErrorInfo:
    """A typed error for the client; anything but a KvpagerError is a bug, logged as such."""
    if isinstance(exc, KvpagerError):
        return ErrorInfo(type=exc.type, message=str(exc), param=getattr(exc, "param", None))
    log.error("request preparation failed", exc_info=exc)
    return ErrorInfo("internal_error", f"the request could not be prepared: {exc!r}")


class Dispatch:
    def __init__(
        self,
        nc: NATS,
        settings: Settings,
        instances: Instances,
        replica_id: str,
        streams: dict[str, Stream],
        end: EndStream,
        lose: EndStream,
        send_finish: SendFinish,
        spawn: Callable[[Coroutine], None],
    ) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.instances = instances
        self.replica_id = replica_id
        self.streams = streams  # the service's own table, read here
        self.end, self.lose, self.send_finish, self.spawn = end, lose, send_finish, spawn

    async def route(
        self,
        stream: Stream,
        ids: list[int],
        params,
        fallback: ErrorInfo | None = None,
        kv_source: KvHandoff | None = None,
        phase: str = "prefill",
    ) -> None:
        try:
            await self._add(stream, ids, params, fallback, kv_source, phase)
        except Exception as exc:  # a bug, or no connection: end the stream, do not leave it
            log.exception("request submission failed", request_id=stream.request_id)
            error = ErrorInfo("internal_error", f"the request could not be queued: {exc!r}")
            await self.lose(stream, error)

    async def _add(
        self,
        stream: Stream,
        ids: list[int],
        params,
        fallback: ErrorInfo | None = None,
        kv_source: KvHandoff | None = None,
        phase: str = "prefill",
    ) -> None:
        """Route the request, then send it; an instance gone meanwhile makes it route again.
        With no instance left, the stream ends with `fallback` (why it moved), if given.
        `phase` "decode": a stream a prefill instance handed on (never back to it)."""
        tried = set(stream.failed_instances)
        if phase == "decode" and kv_source is not None:
            tried.add(kv_source.instance)
        while True:
            try:
                stream.instance = await self._pick(ids, stream.model, frozenset(tried), phase)
            except ModelNotFoundError as exc:
                await self.end(stream, typed_error(exc))
                return
            except NoInstanceError as exc:
                if phase == "decode":  # no decode instance took it: back to a prefill one
                    phase = "prefill"  # (its own: it frees the blocks and finishes the stream)
                    tried.discard(kv_source.instance)
                    continue
                await self.end(stream, fallback or typed_error(exc))
                return
            self.instances.router.routed(stream.request_id, stream.instance, ids)
            result = await self._send_add(stream, ids, params, kv_source)
            if result is not None and (result.error is None or not movable(result.error)):
                break
            fallback = result.error if result is not None else fallback
            tried.add(stream.instance)
        await self._added(stream, result, len(ids), params.max_tokens)

    async def _pick(
        self, token_ids: list[int], model: str | None, exclude: frozenset, phase: str = "prefill"
    ) -> str:
        router = self.instances.router
        try:
            return router.pick(token_ids, model, exclude, phase)
        except NoInstanceError:  # just started, or every instance moved: look again
            await self.instances.discover()
        if not router.instances and self.settings.instance not in exclude:
            return self.settings.instance  # discovery found nothing: our own --instance
        return router.pick(token_ids, model, exclude, phase)

    async def _send_add(
        self, stream: Stream, ids: list[int], params, kv_source: KvHandoff | None = None
    ) -> AddResult | None:
        """Pieces of a long prompt, then the AddRequest; None: nothing serves the instance."""
        subjects = self.subjects.for_instance(stream.instance)
        size = max(1, min(self.settings.piece_tokens, payload_budget(self.nc) // 6))  # 5 B an id
        pieces, tail = split(ids, size, keep=size)
        for piece in pieces:
            await self.nc.publish(
                subjects.scheduler_requests, pack(PromptPiece(stream.request_id, piece))
            )
        reply_to = subjects.tokens(self.replica_id)
        add = AddRequest(
            stream.request_id,
            tail,
            params,
            reply_to,
            stream.cache_salt,
            priority=stream.priority,
            pin_tokens=min(stream.pin_tokens, len(ids)),
            pin_ttl=stream.pin_ttl,
            kv_source=kv_source,
        )
        try:
            return await self._request_add(subjects.scheduler_requests, add)
        except nats.errors.NoRespondersError:
            log.info("instance gone", instance=stream.instance, request_id=stream.request_id)
            self.instances.router.drop(stream.instance)
            return None

    async def _added(
        self, stream: Stream, result: AddResult, num_prompt_tokens: int, max_tokens: int
    ) -> None:
        if result.error is not None:
            await self.end(stream, result.error)
            return
        log.info(
            "request queued",
            request_id=stream.request_id,
            instance=stream.instance,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            num_migrations=stream.num_migrations,
        )
        stream.submitted, stream.scheduler_id = True, result.scheduler_id
        stream.answered.set()
        if stream.aborting:  # an abort or deadline that came while the add was on its way
            await self.send_finish(stream, FinishRequest(stream.request_id, "abort"))

    async def _request_add(self, subject: str, add: AddRequest) -> AddResult:
        """The scheduler's answer; raises NoRespondersError when no scheduler listens."""
        try:
            reply = await self.nc.request(subject, pack(add), timeout=ADD_TIMEOUT_S)
        except nats.errors.TimeoutError:  # the add may have landed: take it back
            await self.nc.publish(subject, pack(FinishRequest(add.request_id, "abort")))
            return AddResult(ErrorInfo("unavailable", "the scheduler did not answer in time"))
        except nats.errors.MaxPayloadError:  # its sampling params: a smaller server than usual
            message = "sampling parameters: the request is over the server's NATS max_payload"
            return AddResult(ErrorInfo("invalid_request", message))
        return msgspec.msgpack.decode(reply.data, type=AddResult)

    async def answered(self, stream: Stream) -> bool:
        """Whether the stream's instance still has it once the add's answer came. That
        instance's deltas come on another subscription than the answer, in no set order: a
        quick instance hands a stream on (its first token computed from cached blocks, or a
        drain) before the answer is in, and the handoff must wait for it, not be lost."""
        instance, answered = stream.instance, stream.answered
        if not stream.submitted:
            try:
                await asyncio.wait_for(answered.wait(), ADD_TIMEOUT_S + 1.0)
            except TimeoutError:
                return False
        current = self.streams.get(stream.request_id) is stream
        return current and stream.instance == instance and stream.submitted

    async def move(
        self, stream: Stream, error: ErrorInfo, kv_handoff: KvHandoff | None = None
    ) -> None:
        """The stream's instance failed: go on elsewhere with the tokens so far (migration),
        or end with `error` when it cannot move; with a typed error past the limit. A drained
        instance hands on the stream's blocks (`kv_handoff`): the next instance reads them
        instead of recomputing the prompt."""
        if self.streams.get(stream.request_id) is not stream or not stream.submitted:
            return
        if stream.kv_held is not None:  # it leaves the decode side: no one reads them now
            await self.drop_hold(stream, stream.kv_held)
            stream.kv_held = None
        moved = stream.continuation() if not stream.aborting else None
        if moved is None:
            if kv_handoff is not None:  # a drained stream that goes nowhere: no one reads them
                await self.drop_hold(stream, kv_handoff)
            await self.lose(stream, error)
            return
        if stream.num_migrations >= self.settings.migration_limit:
            limit = self.settings.migration_limit
            message = f"the stream's instance failed {limit + 1} times; last: {error.message}"
            await self.lose(stream, ErrorInfo("migration_failed", message))
            return
        finish = FinishRequest(stream.request_id, "abort")  # in case it runs there still
        await self.nc.publish(self.requests_subject(stream), pack(finish))
        log.warning(
            "stream moves",
            request_id=stream.request_id,
            instance=stream.instance,
            reason=error.message,
            num_tokens=len(stream.generated),
        )
        self.instances.router.drop(stream.instance)
        stream.moving_from(stream.instance)
        self.spawn(self.route(stream, *moved, fallback=error, kv_source=kv_handoff))

    async def hand_on(self, stream: Stream, handoff: KvHandoff) -> None:
        """Disaggregation: the prefill instance computed the prompt and the first token and
        holds the blocks; the stream goes on on a decode instance, which reads them. Not a
        failure: no migration is counted and the prefill instance stays routable."""
        if self.streams.get(stream.request_id) is not stream or not stream.submitted:
            return
        moved = stream.continuation()
        if moved is None:  # nothing left to generate: the prefill instance would have ended it
            await self.lose(stream, ErrorInfo("internal_error", "a handed-on stream had no rest"))
            return
        log.debug("stream to decode", request_id=stream.request_id, prefill=stream.instance)
        stream.handed_on(handoff)
        self.spawn(self.route(stream, *moved, kv_source=handoff, phase="decode"))

    async def drop_hold(self, stream: Stream, handoff: KvHandoff) -> None:
        """The stream ended before a decode instance read the blocks its prefill instance
        holds: that instance frees them now, not when the hold expires."""
        subject = self.subjects.for_instance(handoff.instance).scheduler_requests
        finish = FinishRequest(stream.request_id, "abort", kv_transfer_id=handoff.transfer_id)
        await self.nc.publish(subject, pack(finish))

    def requests_subject(self, stream: Stream) -> str:
        return self.subjects.for_instance(stream.instance).scheduler_requests
