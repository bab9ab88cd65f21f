"""The Python client of kvpager's NATS API.

    client = await Client.connect("nats://127.0.0.1:4222")
    async for event in client.generate(prompt="Hello", max_tokens=32, temperature=0):
        print(event.text, end="")

Each of a request's `n` samples ends with one final event (`event.is_final`, with the usage so
far); the stream ends after all of them (schemas/public.py: GenerateEvent). Closing or
cancelling the iterator before it sends `llm.abort`. When the client's NATS connection drops,
or a stream hears nothing (not even a keepalive) for `idle_timeout` seconds, its events may be
lost: the client aborts the request and ends the stream with a final event of its own, error type
"connection_lost". A stream whose tokenizer died under `kvpager serve` ends with serve's final
event: error type "unavailable", seq -1 (`event.is_orphaned`). A request with no kvpager
listening raises NoKvpagerError; a gap in `seq` raises StreamGapError.
"""

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import nats.errors
from kvpager.schemas.public import (
    AbortRequest,
    DetokenizeRequest,
    DetokenizeResult,
    ErrorInfo,
    GenerateEvent,
    GenerateRequest,
    Health,
    ModelList,
    Stats,
    TokenizeRequest,
    TokenizeResult,
    Usage,
)
from kvpager.services import credentials
from kvpager.services.subjects import Subjects
from kvpager.services.wire import MSGPACK_HEADERS
from nats.aio.client import Client as NATS

DEFAULT_IDLE_TIMEOUT_S = 30.0  # services send a keepalive about every second
POLL_S = 0.5  # how often a waiting stream looks at the connection
KEEPALIVE_HEADER = "Kvpager-Keepalive"
# nats.connect options that authenticate: given any, no local identity is looked up
AUTH_OPTIONS = {"user", "password", "token", "user_credentials", "nkeys_seed", "signature_cb"}
_event_json = msgspec.json.Decoder(GenerateEvent)
_event_msgpack = msgspec.msgpack.Decoder(GenerateEvent)


class ClientError(Exception):
    """Base of the errors the client raises itself (errors of a request come as events)."""


class NoKvpagerError(ClientError):
    """Nothing subscribes to the subject: no kvpager service is running on this server."""


class StreamGapError(ClientError):
    """An event was lost or reordered: `seq` skipped."""


class Client:
    def __init__(
        self, nc: NATS, prefix: str = "llm", idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    ) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.idle_timeout = idle_timeout
        self._abort_tokens: dict[str, str] = {}  # request id -> what its llm.abort carries

    @classmethod
    async def connect(
        cls,
        url: str | list[str] = "nats://127.0.0.1:4222",
        prefix: str = "llm",
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        **connect_options: Any,
    ) -> "Client":
        """Connect to `url` (comma-separated or a list: a cluster's nodes, failed over in turn);
        `connect_options` go to `nats.connect` (auth, TLS, reconnect policy). Given no
        credentials, the client uses this host's default identity if `kvpager serve` made one
        (services/credentials.py)."""
        servers = [u.strip() for u in url.split(",")] if isinstance(url, str) else list(url)
        if not AUTH_OPTIONS & connect_options.keys():
            local = credentials.local_client()
            if local is not None:
                connect_options = {**credentials.options_of(str(local)), **connect_options}
        nc = await nats.connect(servers, **{"name": "kvpager-client", **connect_options})
        return cls(nc, prefix, idle_timeout)

    async def close(self) -> None:
        await self.nc.drain()

    def generate(
        self, request: GenerateRequest | None = None, /, *, msgpack: bool = False, **fields: Any
    ) -> AsyncIterator[GenerateEvent]:
        """Stream the events of one request, given as a GenerateRequest or as its fields."""
        if request is None:
            request = GenerateRequest(**fields)
        elif fields:
            request = msgspec.structs.replace(request, **fields)
        if request.request_id is None:
            request = msgspec.structs.replace(request, request_id=uuid.uuid4().hex)
        if request.abort_token is None:  # only we and the services see it: our aborts alone
            request = msgspec.structs.replace(request, abort_token=secrets.token_urlsafe(16))
        encode = msgspec.msgpack.encode if msgpack else msgspec.json.encode
        payload = encode(request)
        headers = MSGPACK_HEADERS if msgpack else None
        ids = (request.request_id, request.abort_token)
        return self._events(payload, headers, *ids, num_samples=request.n)

    def generate_raw(
        self, payload: bytes, headers: dict[str, str] | None = None
    ) -> AsyncIterator[GenerateEvent]:
        """Send bytes as they are (tools, tests); no abort on close before an event names it."""
        return self._events(payload, headers, None, None, requested_samples(payload, headers))

    async def _events(
        self,
        payload: bytes,
        headers: dict[str, str] | None,
        request_id: str | None,
        abort_token: str | None,
        num_samples: int = 1,
    ) -> AsyncIterator[GenerateEvent]:
        if request_id is not None and abort_token is not None:  # the first of an id keeps it
            self._abort_tokens.setdefault(request_id, abort_token)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        reconnects = self.nc.stats["reconnects"]
        finished = lost = False
        seq, num_tokens, num_finals = 0, 0, 0
        try:
            await self.nc.publish(self.subjects.generate, payload, reply=inbox, headers=headers)
            while not finished:
                event = await self._next_event(sub, reconnects)
                if event is None:
                    lost = True
                    event = _lost_event(request_id or "", seq, num_tokens, self.idle_timeout)
                elif request_id is not None and event.request_id != request_id:
                    continue  # not this stream's: someone publishing into our inbox
                elif event.seq != seq and not event.is_orphaned:  # the orphan's seq is -1
                    raise StreamGapError(f"{event.request_id}: seq {event.seq}, expected {seq}")
                request_id = request_id or event.request_id  # raw requests: learnt here
                if event.abort_token is not None:  # a request sent without one
                    abort_token = event.abort_token
                    self._abort_tokens.setdefault(request_id, abort_token)
                seq, num_tokens = seq + 1, num_tokens + len(event.token_ids)
                num_finals += event.is_final
                finished = lost or ends_stream(event, num_finals, num_samples)
                yield event
        finally:
            abort_id = request_id if lost or not finished else None
            await self._close_stream(sub, abort_id, abort_token)
            if abort_token is not None and self._abort_tokens.get(request_id) == abort_token:
                del self._abort_tokens[request_id]

    async def _close_stream(self, sub, abort_id: str | None, abort_token: str | None) -> None:
        if self.nc.is_closed:
            return
        await sub.unsubscribe()
        if abort_id is not None:  # while reconnecting, the abort waits in nats-py's buffer
            await self.abort(abort_id, abort_token)

    async def _next_event(self, sub, reconnects: int) -> GenerateEvent | None:
        """The next event; None when it may never come (connection dropped, stream silent)."""
        deadline = time.monotonic() + self.idle_timeout
        while self.nc.stats["reconnects"] == reconnects:  # else events may have been lost
            wait_s = min(POLL_S, deadline - time.monotonic())
            try:
                msg = await sub.next_msg(timeout=max(0.01, wait_s))
            except nats.errors.TimeoutError:
                if not self.nc.is_connected or time.monotonic() >= deadline:
                    return None
                continue
            except nats.errors.ConnectionClosedError:
                return None
            _raise_if_cancelled()
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                raise NoKvpagerError(f"no kvpager listens on {self.subjects.generate!r}")
            if KEEPALIVE_HEADER in headers:
                deadline = time.monotonic() + self.idle_timeout
                continue
            if self.nc.stats["reconnects"] == reconnects:
                msgpack = headers.get("Content-Type") == MSGPACK_HEADERS["Content-Type"]
                return (_event_msgpack if msgpack else _event_json).decode(msg.data)
        return None

    async def abort(self, request_id: str, abort_token: str | None = None) -> None:
        """Abort a request of this client's (its token is known), or of another's with
        `abort_token`; the services ignore an abort without the request's token."""
        abort = AbortRequest(request_id, abort_token or self._abort_tokens.get(request_id))
        await self.nc.publish(self.subjects.abort, msgspec.json.encode(abort))

    async def health(self, timeout: float = 5.0) -> Health:
        return await self._query(self.subjects.health, Health, timeout)

    async def stats(self, timeout: float = 5.0) -> Stats:
        return await self._query(self.subjects.stats, Stats, timeout)

    async def models(self, timeout: float = 5.0) -> ModelList:
        return await self._query(self.subjects.models, ModelList, timeout)

    async def tokenize(self, request: TokenizeRequest, timeout: float = 5.0) -> TokenizeResult:
        """The token ids `generate` would use for the prompt or messages (an error, if bad)."""
        payload = msgspec.json.encode(request)
        return await self._query(self.subjects.tokenize, TokenizeResult, timeout, payload)

    async def detokenize(self, token_ids: list[int], timeout: float = 5.0) -> DetokenizeResult:
        payload = msgspec.json.encode(DetokenizeRequest(token_ids))
        return await self._query(self.subjects.detokenize, DetokenizeResult, timeout, payload)

    async def _query(self, subject: str, kind: type, timeout: float, payload: bytes = b""):
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise NoKvpagerError(f"no kvpager listens on {subject!r}") from exc
        return msgspec.json.decode(msg.data, type=kind)


def _raise_if_cancelled() -> None:
    """Python < 3.12's `asyncio.wait_for` (inside nats-py's `next_msg`) returns a message that
    arrived as the task was cancelled and drops the cancellation: the stream would run on, and
    never send its abort. A task being cancelled has `cancelling()` > 0 until it handles it."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


def ends_stream(event: GenerateEvent, num_finals: int, num_samples: int) -> bool:
    """After `event`, the `num_finals`-th final event of a request of `num_samples` samples:
    whether the stream has ended (schemas/public.py: GenerateEvent). Every sample has ended,
    or the request was refused before its stream began, or this is serve's event for a stream
    whose tokenizer died."""
    refused = event.seq == 0 and event.error is not None and event.num_prompt_tokens is None
    return num_finals >= num_samples or refused or event.is_orphaned


class _Samples(msgspec.Struct):
    n: int = 1


def requested_samples(payload: bytes, headers: dict[str, str] | None = None) -> int:
    """A raw request's `n`, to know when its stream ends (1 when it does not say: a bad
    request is refused with one event)."""
    is_msgpack = (headers or {}).get("Content-Type") == MSGPACK_HEADERS["Content-Type"]
    decode = msgspec.msgpack.decode if is_msgpack else msgspec.json.decode
    try:
        return max(1, decode(payload, type=_Samples).n)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 1


def _lost_event(request_id: str, seq: int, num_tokens: int, idle_timeout: float) -> GenerateEvent:
    """The final event the client makes itself when the stream's own may never come."""
    message = (
        f"the NATS connection dropped or the stream was silent for {idle_timeout} s: events "
        "may be lost, so the request was aborted"
    )
    return GenerateEvent(
        request_id=request_id,
        seq=seq,
        finish_reason="error",
        error=ErrorInfo("connection_lost", message),
        usage=Usage(
            num_prompt_tokens=0, num_completion_tokens=num_tokens, num_cached_prompt_tokens=0
        ),
    )
