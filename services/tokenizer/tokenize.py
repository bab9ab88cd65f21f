"""`llm.tokenize` and `llm.detokenize`: the engine's own input path (chat template, special
tokens, vocabulary checks) as a query, so that clients (the HTTP gateway's /tokenize) count
tokens exactly as `llm.generate` will. No prompt-length cap here: counting a prompt that is too
long is what a client asks this for."""

import msgspec
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)
from kvpager.services.tokenizer.dispatch import typed_error
from kvpager.services.tokenizer.limits import RequestLimits
from kvpager.services.tokenizer.requests import is_msgpack
from kvpager.services.wire import encode_public
from transformers import PreTrainedTokenizerBase


def tokenize(
    body: bytes, headers: dict[str, str] | None, inputs: InputProcessor, limits: RequestLimits
) -> bytes:
    msgpack = is_msgpack(headers)
    try:
        request = _decode(body, msgpack, TokenizeRequest, limits)
        result = TokenizeResult(token_ids=_token_ids(request, inputs))
    except Exception as exc:  # a bad request, or a bug: a typed error either way
        result = TokenizeResult(error=typed_error(exc))
    return encode_public(result, msgpack)[0]


def detokenize(
    body: bytes, headers: dict[str, str] | None, inputs: InputProcessor, limits: RequestLimits
) -> bytes:
    msgpack = is_msgpack(headers)
    try:
        request = _decode(body, msgpack, DetokenizeRequest, limits)
        token_ids = inputs.checked(request.token_ids, "token_ids") if request.token_ids else []
        result = DetokenizeResult(text=_decode_text(inputs.tokenizer, token_ids))
    except Exception as exc:
        result = DetokenizeResult(error=typed_error(exc))
    return encode_public(result, msgpack)[0]


def _decode(body: bytes, msgpack: bool, kind: type, limits: RequestLimits):
    limits.check_body(body)  # the body cap alone: counting a long prompt is the point
    try:
        return (msgspec.msgpack if msgpack else msgspec.json).decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(str(exc)) from exc


def _token_ids(request: TokenizeRequest, inputs: InputProcessor) -> list[int]:
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequestError("exactly one of prompt or messages is required", "prompt")
    if request.tools is not None and request.messages is None:
        raise InvalidRequestError("tools: only with messages", "tools")
    special = request.add_special_tokens
    if request.messages is not None:
        messages = [msgspec.structs.asdict(message) for message in request.messages]
        generation = request.add_generation_prompt
        return inputs.chat_ids(messages, generation, bool(special), tools=request.tools)
    return inputs.prompt_ids(request.prompt, "prompt", special is not False)


def _decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=False)
