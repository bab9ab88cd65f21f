"""A public request's bytes in, a validated and tokenized request out, or a typed error."""

import math
import re
import time
import uuid
from dataclasses import dataclass

import msgspec
from kvpager.engine.frontend.inputs import InputProcessor
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public import ErrorInfo, GenerateRequest
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.tokenizer.limits import RequestLimits

MSGPACK = "application/msgpack"
_PARAM_AT = re.compile(r"`\$\.([A-Za-z_]+)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")

_json_decoder = msgspec.json.Decoder(GenerateRequest)
_msgpack_decoder = msgspec.msgpack.Decoder(GenerateRequest)


@dataclass(frozen=True)
class Prepared:
    """A request ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    timeout_s: float | None  # from now; None: no deadline
    model: str | None = None  # None: any instance's
    abort_token: str | None = None  # the client's; None: the stream makes one
    cache_salt: str | None = None
    prompt_text: str | None = None  # with echo: for the stream's first event
    priority: int = 0
    pin_tokens: int = 0  # `cache`, resolved: the prompt tokens to pin for `pin_ttl` seconds
    pin_ttl: float = 0.0


def is_msgpack(headers: dict[str, str] | None) -> bool:
    return bool(headers) and headers.get("Content-Type", "").startswith(MSGPACK)


def decode_request(body: bytes, msgpack: bool) -> GenerateRequest:
    """Decode and type-check; every failure is an InvalidRequestError naming the field."""
    if not body.strip():
        raise InvalidRequestError("empty request body: expected a JSON object", param=None)
    try:
        return (_msgpack_decoder if msgpack else _json_decoder).decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(str(exc), param=_param_of(str(exc))) from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 is the latter
        kind = "msgpack" if msgpack else "JSON"
        raise InvalidRequestError(f"malformed {kind}: {exc}", param=None) from exc


def request_id_of(body: bytes, msgpack: bool, max_bytes: int) -> str:
    """The request id a client sent, even in a request that fails validation; else a new one.

    A body over `max_bytes` is not parsed.
    """
    if len(body) > max_bytes:
        return uuid.uuid4().hex
    try:
        raw = (msgspec.msgpack if msgpack else msgspec.json).decode(body)
    except (msgspec.DecodeError, ValueError):
        raw = None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    if isinstance(request_id, str) and 0 < len(request_id) <= 256:
        return request_id
    return uuid.uuid4().hex


async def prepare_body(
    body: bytes, msgpack: bool, inputs: InputProcessor, limits: RequestLimits
) -> Prepared:
    """A request's bytes to a Prepared request: size first, then decoding, then the rest."""
    limits.check_body(body)  # before any parsing
    request = decode_request(body, msgpack)
    request_id = request.request_id or uuid.uuid4().hex
    return await prepare(request, request_id, inputs, limits)


async def prepare(
    request: GenerateRequest, request_id: str, inputs: InputProcessor, limits: RequestLimits
) -> Prepared:
    """The service's caps on the fields, SamplingParams, then the one trip down the input
    path, which runs the caps on the prompt once it is tokenized (before any grammar
    compiles, in a worker process)."""
    limits.check_fields(request)
    params = sampling_params(request)
    limits.check_params(params)

    def check_prompt(token_ids: list[int], param: str) -> None:
        limits.check_prompt(len(token_ids), param)
        limits.check_prompt_logprobs(params, len(token_ids))

    messages = None if request.messages is None else [_message(m) for m in request.messages]
    prompt = await inputs.process(
        params,
        prompt=request.prompt,
        messages=messages,
        prompt_token_ids=request.prompt_token_ids,
        tools=request.tools,
        check=check_prompt,
        echo=request.echo,
        cache=request.cache,
    )
    return Prepared(
        request_id=request_id,
        prompt_token_ids=prompt.token_ids,
        params=params,
        stream=request.stream,
        timeout_s=_timeout_s(request),
        model=request.model,
        abort_token=request.abort_token,
        cache_salt=request.cache_salt,
        prompt_text=prompt.text,
        priority=request.priority,
        pin_tokens=prompt.num_pinned_tokens,
        pin_ttl=request.cache.ttl if request.cache is not None else 0.0,
    )


def admission_error(prepared: Prepared, in_flight: bool) -> ErrorInfo | None:
    """Why a well-formed request cannot start now: its id is taken, or its deadline passed."""
    if in_flight:
        message = f"request_id: {prepared.request_id!r} is already in flight"
        return ErrorInfo("invalid_request", message, "request_id")
    if prepared.timeout_s is not None and prepared.timeout_s <= 0:
        return ErrorInfo("deadline_exceeded", "the deadline passed before arrival")
    return None


def sampling_params(request: GenerateRequest) -> SamplingParams:
    fields = {name: getattr(request, name) for name in SamplingParams.__struct_fields__}
    if isinstance(fields["stop"], str):
        fields["stop"] = [fields["stop"]]
    return SamplingParams(**fields)  # raises InvalidRequestError naming the field


def _message(message) -> dict:
    """A message for the chat template: unset fields left out (templates test `is defined`)."""
    fields = msgspec.structs.asdict(message)
    return {name: value for name, value in fields.items() if value is not None}


def _timeout_s(request: GenerateRequest) -> float | None:
    limits = []
    if request.timeout is not None:
        limits.append(request.timeout)
    if request.deadline is not None:
        limits.append(request.deadline - time.time())
    timeout_s = min(limits) if limits else None
    return timeout_s if timeout_s is not None and math.isfinite(timeout_s) else None


def _param_of(message: str) -> str | None:
    match = _PARAM_AT.search(message) or _UNKNOWN_FIELD.search(message)
    return match.group(1) if match else None
