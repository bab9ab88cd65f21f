"""`POST /v1/messages`: Anthropic's Messages API over the chat path.

The request is mapped onto an OpenAI chat request (services/http/messages_request.py) and
built into a Job by the chat route's own `build_job`, so that sampling, tools, structured
outputs, the API key's cache salt and the service's caps are the same; its `cache_control`
becomes the GenerateRequest's `cache`. The events come back as one message or as Anthropic's
server-sent events (message_start, content_block_start/_delta/_stop, message_delta,
message_stop); errors, the stream's first refusal included, in Anthropic's error shape.
"""

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from kvpager.schemas.anthropic import CountTokensRequest, MessagesRequest
from kvpager.schemas.errors import PoisonedRequestError
from kvpager.schemas.public import ChatMessage, GenerateEvent, TokenizeRequest, Usage
from kvpager.services.http import anthropic_shapes as shapes
from kvpager.services.http import tool_output
from kvpager.services.http.decoding import decode, read_body
from kvpager.services.http.errors import HttpError
from kvpager.services.http.gateway import Gateway
from kvpager.services.http.messages_request import chat_request
from kvpager.services.http.request_id import REQUEST_ID
from kvpager.services.http.requests import Job, build_job, chat_messages
from kvpager.services.http.stream_waits import (
    CLIENT_CLOSED,
    KEEPALIVE_S,
    collect_unless_gone,
    events_after,
    first_event,
)
from kvpager.services.http.streams import CutOffResponse, Streams
from kvpager.services.http.structured import ToolSettings, check_compiles, tool_definitions
from kvpager.services.http.tokenize import QUERY_TIMEOUT_S, _ask
from kvpager.services.http.tool_output import ToolDeltas
from kvpager.services.inflight import request_key
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = structlog.get_logger(__name__)


def error_response(exc: HttpError) -> JSONResponse:
    return JSONResponse(shapes.error_body(exc.status, exc.message), status_code=exc.status)


async def create_message(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        job = await _job(gateway, request)
        return await _respond(gateway, job, request)
    except (HttpError, PoisonedRequestError) as exc:
        error = exc if isinstance(exc, HttpError) else HttpError.invalid(str(exc), None)
        log.info("request refused", path=request.url.path, status=error.status, code=error.code)
        return error_response(error)
    except Exception as exc:
        log.error("request failed", path=request.url.path, exc_info=exc)
        return error_response(HttpError(500, f"the gateway failed: {exc!r}", "internal_error"))


async def count_tokens(request: Request) -> Response:
    """`{"input_tokens"}`: the prompt `create` would send, counted by the tokenizer service
    (template, tools and their fallback included), as Anthropic's count_tokens answers."""
    gateway: Gateway = request.app.state.gateway
    http = gateway.http
    try:
        body = await read_body(
            request, gateway.settings.max_request_bytes, http.http_header_timeout
        )
        counted = decode(body, CountTokensRequest, http.allow_unknown_fields)
        fields = msgspec.structs.asdict(counted)
        chat, _ = chat_request(MessagesRequest(max_tokens=1, **fields))
        await gateway.models.resolve(chat.model)
        tools = None if chat.tool_choice == "none" else tool_definitions(chat)
        messages = [ChatMessage(**message) for message in chat_messages(chat.messages)]
        query = TokenizeRequest(messages=messages, tools=tools)
        result = await _ask(gateway.client.tokenize(query, QUERY_TIMEOUT_S))
    except (HttpError, PoisonedRequestError) as exc:
        error = exc if isinstance(exc, HttpError) else HttpError.invalid(str(exc), None)
        return error_response(error)
    return JSONResponse({"input_tokens": len(result.token_ids)})


async def _job(gateway: Gateway, request: Request) -> Job:
    http = gateway.http
    body = await read_body(request, gateway.settings.max_request_bytes, http.http_header_timeout)
    key = request_key(body)
    with gateway.journal.admitting(key):  # a crash in here blames the request
        messages = decode(body, MessagesRequest, http.allow_unknown_fields)
        chat, cache = chat_request(messages)
    await gateway.models.resolve(chat.model)
    request_id = request.headers.get("x-request-id")
    if request_id is not None and not REQUEST_ID.match(request_id):
        raise HttpError.invalid("X-Request-Id: 1 to 200 letters, digits or ._:-", None)
    key_salt = request.scope.get("state", {}).get("key_salt")
    tools = ToolSettings(http.enable_auto_tool_choice, http.tool_call_parser)
    limits = gateway.settings.grammar_limits
    with gateway.journal.admitting(key):
        job = build_job(chat, "chat", request_id, chat.max_tokens, key_salt, tools, limits)
    if job.structured is not None:  # compiled in a worker process, awaited
        await check_compiles(gateway.grammars, *job.structured)
    if cache is not None:
        requests = [msgspec.structs.replace(r, cache=cache) for r in job.requests]
        job = dataclasses.replace(job, requests=requests)
    return dataclasses.replace(job, response_id=shapes.message_id())


async def _respond(gateway: Gateway, job: Job, request: Request) -> Response:
    buffered = gateway.http.stream_buffer_events if job.stream else None
    streams = Streams(gateway.client, job.requests, buffered, KEEPALIVE_S)  # pings
    if not job.stream:
        try:
            return await _whole(job, streams, request)
        finally:
            streams.close()  # ended already, or the client left: its requests are aborted
    try:
        first = await first_event(streams)
    except BaseException:
        streams.close()
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _sse(job, streams, first)
    return CutOffResponse(events, streams, media_type="text/event-stream", headers=headers)


def _head(job: Job) -> dict[str, Any]:
    return {"id": job.response_id, "type": "message", "role": "assistant", "model": job.model}


async def _whole(job: Job, streams: Streams, request: Request) -> Response:
    collected = await collect_unless_gone(_collect(streams), request)
    if collected is None:
        return Response(status_code=CLIENT_CLOSED)
    final, found = collected
    message = {"role": "assistant", "content": final.text}
    if job.tool_mode is not None:
        message, _ = tool_output.message(job.tool_mode, final.text, final.finish_reason)
    called = bool(message.get("tool_calls"))
    reason, sequence = shapes.stop_reason(final.finish_reason, final.stop_reason, called)
    body = {
        **_head(job),
        "content": shapes.content(message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": shapes.usage(found),
    }
    return JSONResponse(body)


async def _collect(streams: Streams) -> tuple[GenerateEvent, Usage | None]:
    """The one sample's final event (with stream: false, all its text) and its usage."""
    final, found = None, None
    while (item := await streams.next()) is not None:
        event = item[1]
        if event.error is not None:
            raise HttpError.from_info(event.error)
        if event.finish_reason is not None:
            final = event
        if event.usage is not None:
            found = event.usage
    if final is None:
        raise HttpError(502, "the stream ended without a final event", "connection_lost")
    return final, found


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


async def _sse(job: Job, streams: Streams, first) -> AsyncIterator[bytes]:
    try:
        async for piece in _pieces(job, streams, first):
            yield piece
    finally:
        streams.close()


async def _pieces(job: Job, streams: Streams, first) -> AsyncIterator[bytes]:
    """message_start, the blocks' events, message_delta and message_stop; an error event ends
    a stream that fails."""
    num_prompt_tokens = (first[1].num_prompt_tokens or 0) if first is not None else 0
    start = {**_head(job), "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = shapes.usage(None, num_prompt_tokens)
    yield _event("message_start", {"type": "message_start", "message": start})
    blocks = shapes.BlockEvents()
    deltas = ToolDeltas(job.tool_mode) if job.tool_mode is not None else None
    async for item in events_after(streams, first):
        if item is None:
            yield _event("ping", {"type": "ping"})
            continue
        if isinstance(item, HttpError):
            yield _error_event(item)
            return
        event = item[1]
        if event.error is not None:
            yield _error_event(HttpError.from_info(event.error))
            return
        final = event.finish_reason is not None
        pieces = [{"content": event.text}] if deltas is None else deltas.deltas(event.text, final)
        for delta in pieces:
            for name, data in blocks.feed(delta):
                yield _event(name, data)
        if final:
            for name, data in blocks.close():
                yield _event(name, data)
            called = deltas is not None and deltas.num_calls > 0
            reason, sequence = shapes.stop_reason(event.finish_reason, event.stop_reason, called)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = shapes.usage(event.usage, num_prompt_tokens)
            yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
    yield _event("message_stop", {"type": "message_stop"})


def _error_event(error: HttpError) -> bytes:
    return _event("error", shapes.error_body(error.status, error.message))
