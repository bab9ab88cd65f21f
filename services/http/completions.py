"""One completion request over NATS: a whole JSON response, or server-sent events.

A stream's status is decided by its first event: a request the tokenizer or the scheduler
refuses (bad input, overloaded, no executor) gets its 4xx/5xx error object, as a whole
response would. If nothing comes within ADMISSION_S (stream_waits.py) the 200 goes out, and a
later failure is an SSE error event followed by `data: [DONE]`, as in vLLM. A client that
disconnects has its requests aborted (`Streams.close`).
"""

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from kvpager.schemas.public import GenerateEvent, Usage
from kvpager.services.http import echo, responses
from kvpager.services.http.errors import HttpError
from kvpager.services.http.requests import Job
from kvpager.services.http.stream_waits import (
    CLIENT_CLOSED,
    collect_unless_gone,
    events_after,
    first_event,
)
from kvpager.services.http.streams import CutOffResponse, Streams
from kvpager.services.http.tokens import TokenTexts
from kvpager.services.http.tool_output import ToolDeltas
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def respond(
    client, job: Job, request: Request, max_buffered: int | None = None, keepalive_s: float = 0.0
) -> Response:
    """`max_buffered`: events a stream may hold for a client that does not read; `keepalive_s`:
    the silence before an SSE comment (0: none)."""
    texts = TokenTexts()  # what the events say of their tokens
    streams = Streams(
        client, job.requests, max_buffered if job.stream else None, keepalive_s or None
    )
    if not job.stream:
        try:
            return await _whole(job, streams, texts, request)
        finally:
            streams.close()  # ended already, or the client left: its requests are aborted
    try:
        first = await first_event(streams)
    except BaseException:
        streams.close()
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _sse(job, streams, first, texts)
    return CutOffResponse(events, streams, media_type="text/event-stream", headers=headers)


async def _whole(job: Job, streams: Streams, texts: TokenTexts, request: Request) -> Response:
    collected = await collect_unless_gone(collect_choices(job, streams, texts), request)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED)
    finals, usages, prompts = collected
    return JSONResponse(responses.whole(job, finals, usages, texts, prompts))


async def collect_choices(job: Job, streams: Streams, texts: TokenTexts):
    """Every choice's final event, the usages, and what the streams said of their prompts
    and of their tokens' texts."""
    finals: dict[int, GenerateEvent] = {}
    usages: dict[int, Usage] = {}  # per stream, the latest: each sample's end has the total
    prompts = echo.Prompts()
    while (item := await streams.next()) is not None:
        index, event = item
        if event.error is not None:
            raise HttpError.from_info(event.error)
        prompts.add(index, event)
        texts.learn(event)
        if event.finish_reason is not None:
            finals[job.choice_index(index, event.index)] = event
        if event.usage is not None:
            usages[index] = event.usage
    return finals, list(usages.values()), prompts


def _data(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _sse(job: Job, streams: Streams, first, texts: TokenTexts) -> AsyncIterator[bytes]:
    try:
        async for piece in _pieces(job, streams, first, texts):
            yield piece
        yield b"data: [DONE]\n\n"
    finally:
        streams.close()


async def _pieces(job: Job, streams: Streams, first, texts: TokenTexts) -> AsyncIterator[bytes]:
    """Role chunks (chat), a chunk per event, the usage chunk; an error event ends it."""
    chunks = _Chunks(job, texts)
    if first is not None:
        chunks.running.prompt[first[0]] = first[1].num_prompt_tokens or 0
    if job.kind == "chat":
        for index in range(len(job.requests) * job.n):
            yield _data(responses.role_chunk(job, index, chunks.running.of(index)))
    usages: dict[int, Usage] = {}  # per stream, the latest: each sample's end has the total
    async for item in events_after(streams, first):
        if item is None:
            yield b": keepalive\n\n"
        elif isinstance(item, HttpError):
            yield _data(item.body())
            return
        else:
            index, event = item
            for chunk in chunks.of_event(index, event):
                yield chunk
            if event.error is not None:
                return
            if event.usage is not None:
                usages[index] = event.usage
    if job.include_usage:
        yield _data(responses.usage_chunk(job, list(usages.values())))


class _Chunks:
    """A stream's chunks per choice: the usage so far, the text offsets (completions'
    text_offset), the prompts the streams echoed."""

    def __init__(self, job: Job, texts: TokenTexts) -> None:
        self.job, self.texts = job, texts
        self.running = responses.RunningUsage(job)
        self.offsets: dict[int, int] = {}  # characters sent per choice
        self.prompts = echo.Prompts()
        self.tools: dict[int, ToolDeltas] = {}  # per choice, with a tool mode

    def of_event(self, index: int, event: GenerateEvent) -> list[bytes]:
        job, texts = self.job, self.texts
        choice = job.choice_index(index, event.index)
        self.running.add(index, event)
        self.prompts.add(index, event)
        texts.learn(event)
        if job.tool_mode is not None and event.error is None:
            deltas = self.tools.setdefault(choice, ToolDeltas(job.tool_mode))
            return _tool_chunks(job, choice, event, deltas, self.running.of(choice))
        shown = responses.shown_prompt(job, self.prompts, choice)  # echo: in the first chunk
        offset = self.offsets.get(choice, 0)
        chunk = _event_chunk(job, choice, event, texts, offset, self.running.of(choice), shown)
        offset += responses.num_chars(event, texts, job)
        self.offsets[choice] = offset + echo.num_chars(shown, texts, job.top_logprobs is not None)
        return [] if chunk is None else [chunk]


def _tool_chunks(
    job: Job, choice: int, event: GenerateEvent, deltas: ToolDeltas, running
) -> list[bytes]:
    """A tool-mode event's chunks: its deltas, then on the last one the finish_reason."""
    final = event.finish_reason is not None
    chunks = [
        _data(responses.delta_chunk(job, choice, delta, running=running))
        for delta in deltas.deltas(event.text, final)
    ]
    if final:
        reason = deltas.finish_reason(event.finish_reason)
        chunks.append(_data(responses.delta_chunk(job, choice, {}, event, running, reason)))
    return chunks


def _event_chunk(
    job: Job, choice: int, event: GenerateEvent, texts, offset: int, running, shown
) -> bytes | None:
    if event.error is not None:
        return _data(HttpError.from_info(event.error).body())
    if not (event.text or event.finish_reason or event.logprobs or shown):
        return None
    return _data(responses.chunk(job, choice, event, texts, offset, running, shown))
