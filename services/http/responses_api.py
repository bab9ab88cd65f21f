"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes a chat request (services/http/responses_input.py) and takes the chat route's
path: the same checks, tools, structured outputs and GenerateRequest, the same streams over
NATS. Its answer is shaped by services/http/responses_output.py. With `store` (the default,
as at OpenAI) the response and its conversation are kept (services/http/response_store.py)
under the caller's API key; `previous_response_id` continues that conversation: its turns and
the new input form the prompt, whose earlier part the prefix cache (and the kv router, which
sends it to the instance holding that prefix) then serves.
"""

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from kvpager.schemas.errors import PoisonedRequestError
from kvpager.schemas.openai import Message
from kvpager.schemas.openai_responses import ResponsesRequest
from kvpager.services.http import decoding
from kvpager.services.http.completions import collect_choices
from kvpager.services.http.errors import HttpError
from kvpager.services.http.gateway import Gateway
from kvpager.services.http.requests import Job, build_job
from kvpager.services.http.response_store import ResponseStore, StoredResponse
from kvpager.services.http.response_store_nats import NatsResponseStore
from kvpager.services.http.responses_input import chat_request, input_messages, renamed
from kvpager.services.http.responses_output import ResponseBuilder, new_id
from kvpager.services.http.stream_waits import (
    CLIENT_CLOSED,
    collect_unless_gone,
    events_after,
    first_event,
)
from kvpager.services.http.streams import CutOffResponse, Streams
from kvpager.services.http.structured import ToolSettings, check_compiles
from kvpager.services.http.tokens import TokenTexts
from kvpager.services.inflight import request_key
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = structlog.get_logger(__name__)

MAX_ID_CHARS = 128
Store = ResponseStore | NatsResponseStore


def routes() -> list[Route]:
    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"]),
    ]


def store_of(gateway: Gateway) -> Store:
    """The gateway's store of responses: its memory, or JetStream's (--responses-store)."""
    http = gateway.http
    if http.responses_store == "nats":
        return NatsResponseStore(
            gateway.client.nc,
            gateway.settings.prefix,
            http.responses_max_stored,
            http.responses_max_bytes,
            http.responses_ttl,
        )
    return ResponseStore(
        http.responses_max_stored,
        http.responses_max_bytes,
        http.responses_ttl,
        http.responses_max_stored_per_key,
    )


async def create(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        response_id = new_id("resp")  # also its GenerateRequest's id on NATS (`<id>-0`)
        parsed, job, history = await _prepare(request, gateway, response_id)
        builder = ResponseBuilder(job, parsed, response_id)
        keep = _Keeper(request, parsed, history) if parsed.store else None
        buffered = gateway.http.stream_buffer_events
        keepalive = gateway.http.sse_keepalive or None
        streams = Streams(gateway.client, job.requests, buffered if job.stream else None, keepalive)
        if not job.stream:
            return await _whole(streams, builder, request, keep)
        return await _stream(streams, builder, keep)
    except (HttpError, PoisonedRequestError) as exc:
        error = renamed(exc) if isinstance(exc, HttpError) else HttpError.invalid(str(exc), None)
        log.info("request refused", path=request.url.path, status=error.status, code=error.code)
        return JSONResponse(error.body(), status_code=error.status)


async def stored(request: Request) -> Response:
    """GET: the stored response; DELETE: forget it. 404 unless the caller's key stored it."""
    response_id = request.path_params["response_id"]
    try:
        if len(response_id) <= MAX_ID_CHARS:
            found = await _stored(request, response_id)
            if found is not None:
                return JSONResponse(found)
        error = _not_found(response_id, None)
    except HttpError as exc:  # the store is unavailable
        error = exc
    return JSONResponse(error.body(), status_code=error.status)


async def _stored(request: Request, response_id: str) -> dict[str, Any] | None:
    """The body of the request's answer (GET, DELETE); None when there is no such response."""
    store: Store = request.app.state.responses
    owner = _owner(request)
    if request.method == "DELETE":
        if await store.delete(owner, response_id):
            return {"id": response_id, "object": "response", "deleted": True}
        return None
    found = await store.get(owner, response_id)
    return None if found is None else found.response


async def _prepare(
    request: Request, gateway: Gateway, response_id: str
) -> tuple[ResponsesRequest, Job, list]:
    """The request, checked; its job; the earlier turns it continues."""
    http = gateway.http
    body = await decoding.read_body(request, gateway.settings.max_request_bytes,
                                    http.http_header_timeout)  # fmt: skip
    key = request_key(body)
    with gateway.journal.admitting(key):  # a crash in here blames the request
        parsed = decoding.decode(body, ResponsesRequest, http.allow_unknown_fields)
    card = await gateway.models.resolve(parsed.model)
    history = await _history(request, parsed)
    default = max(1, min(http.default_max_tokens, card.max_model_len // 2))
    key_salt = request.scope.get("state", {}).get("key_salt")
    tools = ToolSettings(http.enable_auto_tool_choice, http.tool_call_parser)
    with gateway.journal.admitting(key):
        chat = chat_request(parsed, history)
        job = build_job(chat, "chat", response_id, default, key_salt, tools,
                        gateway.settings.grammar_limits)  # fmt: skip
    if job.structured is not None:  # compiled in a worker process, awaited
        await check_compiles(gateway.grammars, *job.structured)
    return parsed, job, history


async def _history(request: Request, parsed: ResponsesRequest) -> list[Message]:
    if parsed.previous_response_id is None:
        return []
    store: Store = request.app.state.responses
    found = await store.get(_owner(request), parsed.previous_response_id)
    if found is None:
        raise _not_found(parsed.previous_response_id, "previous_response_id")
    return found.turns


def _owner(request: Request) -> str:
    """The caller's API key, as its cache salt; "" on a gateway without keys."""
    return request.scope.get("state", {}).get("key_salt") or ""


def _not_found(response_id: str, param: str | None) -> HttpError:
    shown = response_id[:MAX_ID_CHARS]
    what = "Previous response" if param else "Response"
    return HttpError(404, f"{what} with id '{shown}' not found.", "not_found", param)


class _Keeper:
    """Stores a finished response with its conversation: the earlier turns, this input, the
    answer."""

    def __init__(self, request: Request, parsed: ResponsesRequest, history: list) -> None:
        self.store: Store = request.app.state.responses
        self.owner = _owner(request)
        self.turns = history + input_messages(parsed)

    async def keep(self, builder: ResponseBuilder) -> None:
        if builder.status not in ("completed", "incomplete"):
            return
        conversation = StoredResponse(builder.body(), self.turns + builder.turns())
        try:
            await self.store.put(self.owner, builder.response_id, conversation)
        except HttpError as exc:  # the answer stands; a later GET of it is a 404
            log.warning("response not stored", response_id=builder.response_id, error=exc.message)


async def _whole(
    streams: Streams, builder: ResponseBuilder, request: Request, keep: _Keeper | None
) -> Response:
    """The whole response; 499 if the client leaves first (its request is aborted)."""
    try:
        work = collect_choices(builder.job, streams, TokenTexts())
        collected = await collect_unless_gone(work, request)
    finally:
        streams.close()
    if collected is None:
        return Response(status_code=CLIENT_CLOSED)
    finals, usages, _ = collected
    builder.feed(finals[0])
    builder.usage = usages[0] if usages else builder.usage
    if keep is not None:
        await keep.keep(builder)
    return JSONResponse(builder.body())


async def _stream(streams: Streams, builder: ResponseBuilder, keep: _Keeper | None) -> Response:
    try:
        first = await first_event(streams)  # a refusal is the response's status, as on chat
    except BaseException:
        streams.close()
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _sse(streams, builder, first, keep)
    return CutOffResponse(events, streams, media_type="text/event-stream", headers=headers)


async def _sse(streams: Streams, builder: ResponseBuilder, first, keep) -> AsyncIterator[bytes]:
    try:
        for event in builder.start():
            yield _data(event)
        async for item in events_after(streams, first):
            if item is None:
                yield b": keepalive\n\n"
                continue
            error = renamed(item) if isinstance(item, HttpError) else _error_of(item[1])
            events = builder.fail(error) if error is not None else builder.feed(item[1])
            if keep is not None and builder.status in ("completed", "incomplete"):
                await keep.keep(builder)  # before the client hears of it: a GET then finds it
            for event in events:
                yield _data(event)
            if error is not None:
                return
    finally:
        streams.close()


def _error_of(event) -> HttpError | None:
    return None if event.error is None else renamed(HttpError.from_info(event.error))


def _data(event: dict[str, Any]) -> bytes:
    head = f"event: {event['type']}\n".encode()
    return head + b"data: " + msgspec.json.encode(event) + b"\n\n"
