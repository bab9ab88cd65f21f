"""The Python client of kvpager's NATS API.

    client = await Client.connect("nats://127.0.0.1:4222")
    async for event in client.generate(prompt="Hello", max_tokens=32, temperature=0):
        print(event.text, end="")

Closing or cancelling the iterator before its final event sends `llm.abort`. A request with
no kvpager listening raises NoKvpagerError; a gap in `seq` raises StreamGapError.
"""

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS

from schemas.public import AbortRequest, GenerateEvent, GenerateRequest, Health, ModelList, Stats
from services.subjects import Subjects
from services.wire import MSGPACK_HEADERS

DEFAULT_IDLE_TIMEOUT_S = 300.0
_event_json = msgspec.json.Decoder(GenerateEvent)
_event_msgpack = msgspec.msgpack.Decoder(GenerateEvent)


class ClientError(Exception):
    """Base of the errors the client raises itself (errors of a request come as events)."""


class NoKvpagerError(ClientError):
    """Nothing subscribes to the subject: no kvpager service is running on this server."""


class StreamGapError(ClientError):
    """An event was lost or reordered: `seq` skipped."""


class StreamTimeoutError(ClientError):
    """No event came for `idle_timeout` seconds."""


class Client:
    def __init__(
        self, nc: NATS, prefix: str = "llm", idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S
    ) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.idle_timeout = idle_timeout

    @classmethod
    async def connect(
        cls, url: str = "nats://127.0.0.1:4222", prefix: str = "llm", **options: Any
    ) -> "Client":
        return cls(await nats.connect(url, name="kvpager-client"), prefix, **options)

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
        encode = msgspec.msgpack.encode if msgpack else msgspec.json.encode
        payload = encode(request)
        return self._events(payload, MSGPACK_HEADERS if msgpack else None, request.request_id)

    def generate_raw(
        self, payload: bytes, headers: dict[str, str] | None = None
    ) -> AsyncIterator[GenerateEvent]:
        """Send bytes as they are (tools, tests); no abort on close, as the id is unknown."""
        return self._events(payload, headers, None)

    async def _events(
        self, payload: bytes, headers: dict[str, str] | None, request_id: str | None
    ) -> AsyncIterator[GenerateEvent]:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        finished = False
        try:
            await self.nc.publish(self.subjects.generate, payload, reply=inbox, headers=headers)
            seq = 0
            while not finished:
                event = await self._next_event(sub)
                if event.seq != seq:
                    raise StreamGapError(f"{event.request_id}: seq {event.seq}, expected {seq}")
                seq += 1
                finished = event.is_final
                yield event
        finally:
            await sub.unsubscribe()
            if not finished and request_id is not None and not self.nc.is_closed:
                await self.abort(request_id)

    async def _next_event(self, sub) -> GenerateEvent:
        try:
            msg = await sub.next_msg(timeout=self.idle_timeout)
        except nats.errors.TimeoutError as exc:
            raise StreamTimeoutError(f"no event for {self.idle_timeout} s") from exc
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoKvpagerError(f"no kvpager listens on {self.subjects.generate!r}")
        msgpack = msg.headers and msg.headers.get("Content-Type") == MSGPACK_HEADERS["Content-Type"]
        return (_event_msgpack if msgpack else _event_json).decode(msg.data)

    async def abort(self, request_id: str) -> None:
        await self.nc.publish(self.subjects.abort, msgspec.json.encode(AbortRequest(request_id)))

    async def health(self, timeout: float = 5.0) -> Health:
        return await self._query(self.subjects.health, Health, timeout)

    async def stats(self, timeout: float = 5.0) -> Stats:
        return await self._query(self.subjects.stats, Stats, timeout)

    async def models(self, timeout: float = 5.0) -> ModelList:
        return await self._query(self.subjects.models, ModelList, timeout)

    async def _query(self, subject: str, kind: type, timeout: float):
        try:
            msg = await self.nc.request(subject, b"", timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise NoKvpagerError(f"no kvpager listens on {subject!r}") from exc
        return msgspec.json.decode(msg.data, type=kind)
