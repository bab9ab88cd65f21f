"""The gateway's routes: OpenAI's completions, chat completions and models, vLLM's tokenize,
detokenize and version, health, metrics.

POST /v1/completions, /v1/chat/completions  ->  GenerateRequests on `llm.generate`
GET  /v1/models, /v1/models/{id}  ->  llm.models      GET /health  ->  llm.health
POST /v1/messages  ->  Anthropic's Messages API, over the chat path (services/http/messages.py)
POST /tokenize, /detokenize  ->  llm.tokenize, llm.detokenize      GET /version
GET  /metrics    ->  llm.stats of every instance, Prometheus text format
"""

import time

import structlog
from kvpager.schemas.errors import PoisonedRequestError
from kvpager.schemas.public import ModelCard
from kvpager.services.http import messages, metrics, responses_api, tokenize
from kvpager.services.http.completions import respond
from kvpager.services.http.decoding import read_body
from kvpager.services.http.errors import HttpError, error_body
from kvpager.services.http.gateway import Gateway
from kvpager.services.http.guard import Guard
from kvpager.services.http.request_id import REQUEST_ID, EchoRequestId
from kvpager.services.http.requests import COMPLETION_MAX_TOKENS, Kind, build_job, decode
from kvpager.services.http.stream_waits import as_http_error
from kvpager.services.http.structured import ToolSettings, check_compiles
from kvpager.services.inflight import request_key
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

log = structlog.get_logger(__name__)


def build_app(gateway: Gateway, metrics_only: bool = False) -> Starlette:
    routes = [Route("/metrics", _metrics, methods=["GET"])]
    if not metrics_only:
        routes += [
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
            Route("/v1/messages", messages.create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", _model, methods=["GET"]),
            Route("/tokenize", tokenize.tokenize, methods=["POST"]),
            Route("/detokenize", tokenize.detokenize, methods=["POST"]),
            Route("/version", tokenize.show_version, methods=["GET"]),
            Route("/health", _health, methods=["GET"]),
            *responses_api.routes(),
        ]
    handlers = {HTTPException: _http_exception, Exception: _internal_error}
    http = gateway.http
    guard = Middleware(
        Guard, api_keys=http.api_keys, hosts=http.hosts, max_in_flight=http.http_max_concurrency
    )
    middleware = [Middleware(EchoRequestId), guard]
    if http.origins:  # outermost, as vLLM's: a browser's preflight needs no API key
        cors = Middleware(
            CORSMiddleware, allow_origins=list(http.origins), allow_methods=["*"],
            allow_headers=["*"],
        )  # fmt: skip
        middleware.insert(0, cors)
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)
    app.state.gateway = gateway
    app.state.responses = responses_api.store_of(gateway)  # POST /v1/responses' store
    return app


def _error(exc: HttpError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _completions(request: Request) -> Response:
    return await _complete(request, "completion")


async def _chat_completions(request: Request) -> Response:
    return await _complete(request, "chat")


async def _complete(request: Request, kind: Kind) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        body = await read_body(
            request, gateway.settings.max_request_bytes, gateway.http.http_header_timeout
        )
        key = request_key(body)
        with gateway.journal.admitting(key):  # a crash in here blames the request
            openai_request = decode(body, kind, gateway.http.allow_unknown_fields)
        card = await gateway.models.resolve(openai_request.model)
        default = COMPLETION_MAX_TOKENS
        if kind == "chat":  # at most half the context: the prompt must fit beside it
            default = max(1, min(gateway.http.default_max_tokens, card.max_model_len // 2))
        key_salt = request.scope.get("state", {}).get("key_salt")
        http = gateway.http
        tools = ToolSettings(http.enable_auto_tool_choice, http.tool_call_parser)
        limits = gateway.settings.grammar_limits
        request_id = _request_id(request)
        with gateway.journal.admitting(key):
            job = build_job(openai_request, kind, request_id, default, key_salt, tools, limits)
        if job.structured is not None:  # compiled in a worker process, awaited
            await check_compiles(gateway.grammars, *job.structured)
        buffered = gateway.http.stream_buffer_events
        return await respond(gateway.client, job, request, buffered, http.sse_keepalive)
    except (HttpError, PoisonedRequestError) as exc:
        error = exc if isinstance(exc, HttpError) else HttpError.invalid(str(exc), None)
        log.info("request refused", path=request.url.path, status=error.status, code=error.code)
        return _error(error)


def _request_id(request: Request) -> str | None:
    value = request.headers.get("x-request-id")
    if value is not None and not REQUEST_ID.match(value):
        message = "X-Request-Id: 1 to 200 letters, digits or ._:-"
        raise HttpError.invalid(message, None)
    return value


async def _models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        cards = await gateway.models.cards(fresh=True)
    except HttpError as exc:
        return _error(exc)
    data = [_model_object(gateway, card) for card in cards]
    return JSONResponse({"object": "list", "data": data})


async def _model(request: Request) -> Response:
    """One model by its OpenAI name (or full path); 404 with OpenAI's error object if none."""
    gateway: Gateway = request.app.state.gateway
    try:
        card = await gateway.models.resolve(request.path_params["model_id"])
    except HttpError as exc:
        return _error(exc)
    return JSONResponse(_model_object(gateway, card))


def _model_object(gateway: Gateway, card: ModelCard) -> dict:
    return {
        "id": gateway.models.name(card),
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvpager",
        "root": card.id,
        "max_model_len": card.max_model_len,
    }


async def _health(request: Request) -> Response:
    """200 when a tokenizer, the scheduler and its executor answer; 503 otherwise."""
    gateway: Gateway = request.app.state.gateway
    try:
        health = await gateway.client.health(timeout=3.0)
    except Exception as exc:
        return _error(as_http_error(exc))
    body = {"status": health.status, "model": health.model, "message": health.message}
    return JSONResponse(body, status_code=200 if health.status == "ok" else 503)


async def _metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    subject, timeout_s = gateway.client.subjects.stats, gateway.http.stats_timeout
    stats = await metrics.gather_stats(gateway.client.nc, subject, timeout_s)
    return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown routes and methods get OpenAI's error object too."""
    body = error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "")
    return JSONResponse(body, status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("request failed", path=request.url.path, exc_info=exc)
    body = error_body(500, f"the gateway failed: {exc!r}", "internal_error")
    return JSONResponse(body, status_code=500)
