"""The events of one HTTP request's GenerateRequests, merged, in arrival order per request.

Each request is read by an asyncio task of its own, not by the HTTP handler: Starlette cancels
a handler whose client disconnected through an anyio cancel scope, which cancels every await
after it as well, so the client library's clean-up (unsubscribe, `llm.abort`) would be cut
short. `close()` cancels the readers once, the plain asyncio way; each reader's stream then
sends its abort and the request's blocks are freed.

At most `max_buffered` events wait for the handler. A client that stops reading blocks the
handler in uvicorn's flow control; the events pile up here, and past the bound the requests
are aborted and `overflowed` is set: `CutOffResponse` then drops the connection.
"""

import asyncio
import contextlib

import anyio
import structlog
from kvpager.schemas.public import GenerateEvent, GenerateRequest
from kvpager.services.client import Client
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = structlog.get_logger(__name__)

ABORT_EXTENSION = "kvpager.abort_connection"  # scope["extensions"]: services/http/protocol.py
_END = None  # a reader's last item


class Streams:
    def __init__(
        self,
        client: Client,
        requests: list[GenerateRequest],
        max_buffered: int | None = None,
        keepalive_s: float | None = None,
    ) -> None:
        """`keepalive_s`: the silence after which events_after (stream_waits.py) yields a
        keepalive; None: never."""
        self.keepalive_s = keepalive_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(requests)
        self._max_buffered = max_buffered
        self.overflowed = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._readers = [
            loop.create_task(self._read(client, index, request))
            for index, request in enumerate(requests)
        ]

    async def _read(self, client: Client, index: int, request: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(client.generate(request)) as events:
                async for event in events:
                    if self._full():
                        self._overflow(request.request_id)
                        return  # closing the stream aborts the request
                    self._queue.put_nowait((index, event))
        except Exception as exc:  # no tokenizer, a lost event, the connection: for the handler
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _END))

    def _full(self) -> bool:
        return self._max_buffered is not None and self._queue.qsize() >= self._max_buffered

    def _overflow(self, request_id: str) -> None:
        log.warning("stream cut off: its client does not read", request_id=request_id)
        self.overflowed.set()
        self.close()

    async def next(self, timeout: float | None = None) -> tuple[int, GenerateEvent] | None:
        """The next (request index, event); None once every stream has ended. TimeoutError
        when nothing came for `timeout` seconds; a reader's exception is raised here."""
        while self._open:
            index, item = await asyncio.wait_for(self._queue.get(), timeout)
            if item is _END:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        return None

    def close(self) -> None:
        """Stop reading: streams that have not ended are aborted."""
        for reader in self._readers:
            if reader is not asyncio.current_task():
                reader.cancel()


class CutOffResponse(StreamingResponse):
    """Server-sent events that stop, and drop the connection, when `streams` overflow."""

    def __init__(self, content, streams: Streams, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def cut_off() -> None:
                await self.streams.overflowed.wait()
                group.cancel_scope.cancel()
                # closing would wait for a client that never reads to take the buffered rest
                abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
                if abort is not None:
                    abort()

            group.start_soon(cut_off)
            try:
                await super().__call__(scope, receive, send)
            finally:
                group.cancel_scope.cancel()
                self.streams.close()
