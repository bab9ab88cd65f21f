"""How every generating route waits on its NATS streams: the first event (a refusal becomes the
response's status), the events after it with keepalives, and a whole response collected unless
the client leaves first. Chat and completions, Responses and Messages share these, so a client
that disconnects aborts its requests the same way on each.
"""

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from kvpager.schemas.public import GenerateEvent
from kvpager.services.client import NoKvpagerError, StreamGapError
from kvpager.services.http.errors import HttpError
from kvpager.services.http.streams import Streams
from starlette.requests import Request

ADMISSION_S = 5.0  # refusals come back in milliseconds; the first token may take much longer
KEEPALIVE_S = 15.0  # Anthropic's ping when a Messages stream is silent this long
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away

T = TypeVar("T")


def as_http_error(exc: Exception) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, NoKvpagerError):
        return HttpError(503, f"no kvpager tokenizer is running: {exc}", "unavailable")
    if isinstance(exc, StreamGapError):
        return HttpError(502, f"an event of the stream was lost: {exc}", "connection_lost")
    return HttpError(502, f"the NATS stream failed: {exc!r}", "connection_lost")


async def first_event(streams: Streams) -> tuple[int, GenerateEvent] | None:
    """The first event, unless it is a refusal (raised); None if it has not come yet."""
    try:
        item = await streams.next(ADMISSION_S)
    except TimeoutError:
        return None
    except Exception as exc:
        raise as_http_error(exc) from exc
    if item is None:
        raise HttpError(502, "the stream ended without an event", "connection_lost")
    if item[1].error is not None:
        raise HttpError.from_info(item[1].error)
    return item


async def events_after(streams: Streams, first) -> AsyncIterator:
    """(request index, event)s; None after `streams.keepalive_s` of silence (if set); an
    HttpError last if the stream failed."""
    if first is not None:
        yield first
    while True:
        try:
            item = await streams.next(streams.keepalive_s)
        except TimeoutError:
            yield None
            continue
        except Exception as exc:
            yield as_http_error(exc)
            return
        if item is None:
            return
        yield item


async def client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_unless_gone(work: Coroutine[Any, Any, T], request: Request) -> T | None:
    """`work`'s result, or None if the client disconnected first (`work` is then cancelled:
    the caller answers CLIENT_CLOSED and closing its streams aborts the requests). A failure
    of `work` is raised as an HttpError."""
    collect = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()  # the client went away
            # a cancel is only a request: until the task has unwound it is neither cancelled
            # nor done, and asking for its exception raised InvalidStateError
            await asyncio.wait({collect})
    if collect.cancelled():
        return None
    if collect.exception() is not None:
        raise as_http_error(collect.exception())
    return collect.result()
