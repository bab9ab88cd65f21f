"""The gateway's routes: OpenAI's completions, chat completions and models, health, metrics.

POST /v1/completions, /v1/chat/completions  ->  GenerateRequests on `llm.generate`
GET  /v1/models  ->  llm.models      GET /health  ->  llm.health
GET  /metrics    ->  llm.stats of every instance, Prometheus text format
"""

import re
import time
from dataclasses import dataclass

import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.client import Client
from services.http import metrics
from services.http.completions import as_http_error, respond
from services.http.errors import HttpError, error_body
from services.http.models import Models
from services.http.requests import COMPLETION_MAX_TOKENS, Kind, build_job, decode
from services.http.tokens import TokenTexts
from services.settings import HttpSettings, Settings

log = structlog.get_logger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


@dataclass
class Gateway:
    client: Client
    settings: Settings
    http: HttpSettings
    models: Models
    tokens: TokenTexts

    @classmethod
    def create(cls, client: Client, settings: Settings, http: HttpSettings) -> "Gateway":
        models = Models(client, http.served_model_name)
        return cls(client, settings, http, models, TokenTexts(settings.model))


def build_app(gateway: Gateway, metrics_only: bool = False) -> Starlette:
    routes = [Route("/metrics", _metrics, methods=["GET"])]
    if not metrics_only:
        routes += [
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
            Route("/v1/models", _models, methods=["GET"]),
            Route("/health", _health, methods=["GET"]),
        ]
    handlers = {HTTPException: _http_exception, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.gateway = gateway
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
        body = await _body(request, gateway.settings.max_request_bytes)
        openai_request = decode(body, kind, gateway.http.allow_unknown_fields)
        card = await gateway.models.resolve(openai_request.model)
        default = COMPLETION_MAX_TOKENS
        if kind == "chat":  # at most half the context: the prompt must fit beside it
            default = max(1, min(gateway.http.default_max_tokens, card.max_model_len // 2))
        job = build_job(openai_request, kind, _request_id(request), default)
        return await respond(gateway.client, job, gateway.tokens, request)
    except HttpError as exc:
        log.info("request refused", path=request.url.path, status=exc.status, code=exc.code)
        return _error(exc)


async def _body(request: Request, limit: int) -> bytes:
    """The body, refused unread past `limit` bytes."""
    size = int(request.headers.get("content-length") or 0)
    if size > limit:
        raise HttpError(413, f"the request body is over {limit} bytes", "invalid_request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"the request body is over {limit} bytes", "invalid_request")
        chunks.append(chunk)
    return b"".join(chunks)


def _request_id(request: Request) -> str | None:
    value = request.headers.get("x-request-id")
    if value is not None and not _REQUEST_ID.match(value):
        message = "X-Request-Id: 1 to 200 letters, digits or ._:-"
        raise HttpError.invalid(message, None)
    return value


async def _models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        cards = await gateway.models.cards(fresh=True)
    except HttpError as exc:
        return _error(exc)
    data = [
        {
            "id": gateway.models.name(card),
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kvpager",
            "root": card.id,
            "max_model_len": card.max_model_len,
        }
        for card in cards
    ]
    return JSONResponse({"object": "list", "data": data})


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
