"""The events of one HTTP request's GenerateRequests, merged, in arrival order per request.

Each request is read by an asyncio task of its own, not by the HTTP handler: Starlette cancels
a handler whose client disconnected through an anyio cancel scope, which cancels every await
after it as well, so the client library's clean-up (unsubscribe, `llm.abort`) would be cut
short. `close()` cancels the readers once, the plain asyncio way; each reader's stream then
sends its abort and the request's blocks are freed.
"""

import asyncio

from schemas.public import GenerateEvent, GenerateRequest
from services.client import Client

_END = None  # a reader's last item


class Streams:
    def __init__(self, client: Client, requests: list[GenerateRequest]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(requests)
        loop = asyncio.get_running_loop()
        self._readers = [
            loop.create_task(self._read(client, index, request))
            for index, request in enumerate(requests)
        ]

    async def _read(self, client: Client, index: int, request: GenerateRequest) -> None:
        try:
            async for event in client.generate(request):
                self._queue.put_nowait((index, event))
        except Exception as exc:  # no tokenizer, a lost event, the connection: for the handler
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _END))

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
            reader.cancel()
