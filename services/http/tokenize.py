"""vLLM's utility routes: POST /tokenize and /detokenize (through the tokenizer service's
`llm.tokenize` / `llm.detokenize`, so counts are those `llm.generate` will see), GET /version."""

from importlib.metadata import PackageNotFoundError, version

import nats.errors
from kvpager.schemas.openai import DetokenizeBody, TokenizeBody
from kvpager.schemas.public import ChatMessage, ModelCard, TokenizeRequest
from kvpager.services.client import ClientError
from kvpager.services.http.decoding import decode, read_body
from kvpager.services.http.errors import HttpError
from kvpager.services.http.gateway import Gateway
from kvpager.services.http.requests import chat_messages
from kvpager.services.http.structured import tool_definitions
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

QUERY_TIMEOUT_S = 10.0


async def tokenize(request: Request) -> Response:
    """{"count", "max_model_len", "tokens"}, as vLLM answers."""
    gateway: Gateway = request.app.state.gateway
    try:
        body = await _decoded(request, gateway, TokenizeBody)
        card = await _card(gateway, body.model)
        result = await _ask(gateway.client.tokenize(_tokenize_request(body), QUERY_TIMEOUT_S))
    except HttpError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    tokens = result.token_ids
    answer = {"count": len(tokens), "max_model_len": card.max_model_len, "tokens": tokens}
    return JSONResponse({**answer, "token_strs": None})


async def detokenize(request: Request) -> Response:
    """{"prompt"}: the text of `tokens`, special tokens included."""
    gateway: Gateway = request.app.state.gateway
    try:
        body = await _decoded(request, gateway, DetokenizeBody)
        await _card(gateway, body.model)
        result = await _ask(gateway.client.detokenize(body.tokens, QUERY_TIMEOUT_S))
    except HttpError as exc:
        if exc.param == "token_ids":
            exc.param, exc.message = "tokens", exc.message.replace("token_ids", "tokens")
        return JSONResponse(exc.body(), status_code=exc.status)
    return JSONResponse({"prompt": result.text})


async def show_version(request: Request) -> Response:
    try:
        return JSONResponse({"version": version("kvpager")})
    except PackageNotFoundError:  # run from a source tree that was never installed
        return JSONResponse({"version": "unknown"})


async def _decoded(request: Request, gateway: Gateway, kind: type):
    body = await read_body(
        request, gateway.settings.max_request_bytes, gateway.http.http_header_timeout
    )
    return decode(body, kind, gateway.http.allow_unknown_fields)


async def _card(gateway: Gateway, model: str | None) -> ModelCard:
    """The model named, or the first one served (vLLM's `model` is optional here)."""
    if model is not None:
        return await gateway.models.resolve(model)
    cards = await gateway.models.cards()
    if not cards:
        message = "no model is served yet: no executor is attached; retry soon"
        raise HttpError(503, message, "executor_unavailable")
    return cards[0]


def _tokenize_request(body: TokenizeBody) -> TokenizeRequest:
    messages = None
    if body.messages is not None:
        messages = [ChatMessage(**message) for message in chat_messages(body.messages)]
    return TokenizeRequest(
        prompt=body.prompt,
        messages=messages,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        tools=tool_definitions(body),
    )


async def _ask(query):
    """The tokenizer's result, or its error as an HttpError."""
    try:
        result = await query
    except (TimeoutError, ClientError, nats.errors.Error) as exc:
        raise HttpError(503, f"no kvpager tokenizer answers: {exc!r}", "unavailable") from exc
    if result.error is not None:
        raise HttpError.from_info(result.error)
    return result
