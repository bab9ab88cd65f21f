"""Request bodies into the gateway's msgspec structs, with errors that name the field.

Unknown fields are refused (400 naming the field), as at OpenAI; with `--allow-unknown-fields`
they are logged and dropped wherever they are (top level or nested), as vLLM does.
"""

import asyncio
import re
from typing import Any

import msgspec
import structlog
from kvpager.services.http.errors import HttpError
from starlette.requests import Request

log = structlog.get_logger(__name__)

MAX_IGNORED = 64  # unknown fields dropped from one body, at most
_AT = re.compile(r" - at `\$\.?([^`]*)`")
_NAMED = re.compile(r"field `([^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]+)`(?: - at `\$([^`]*)`)?$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refused unread past `limit` bytes, and with a 408 if it takes over
    `timeout_s` (a client trickling its body holds a connection and a task)."""
    size = int(request.headers.get("content-length") or 0)
    if size > limit:
        raise HttpError(413, f"the request body is over {limit} bytes", "invalid_request")
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except TimeoutError as exc:
        message = f"the request body took over {timeout_s} s"
        raise HttpError(408, message, "request_timeout") from exc


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"the request body is over {limit} bytes", "invalid_request")
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, kind: type, allow_unknown: bool = False) -> Any:
    """`body` as a `kind`; HttpError 400 on empty, malformed or invalid bodies."""
    if not body.strip():
        raise HttpError.invalid("empty request body: expected a JSON object", None)
    try:
        if allow_unknown:
            return _lenient(msgspec.json.decode(body), kind)
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise HttpError.invalid(str(exc), param_of(str(exc))) from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HttpError.invalid(f"malformed JSON: {exc}", None) from exc
    except RecursionError:  # nested past the decoder's recursion: the client's error
        raise HttpError.invalid("request body: JSON nested too deep", None) from None


def param_of(message: str) -> str | None:
    """The field a msgspec error names: an unknown field with its path (`messages[0].mood`),
    the path of a bad value, or the missing field."""
    unknown = _UNKNOWN.match(message)
    if unknown:
        return _dotted(unknown.group(2) or "", unknown.group(1))
    match = _AT.search(message)
    if match and match.group(1):
        return match.group(1)
    match = _NAMED.search(message)
    return match.group(1) if match else None


def _lenient(raw: Any, kind: type) -> Any:
    """Convert, dropping each unknown field msgspec names until none is left."""
    ignored = []
    for _ in range(MAX_IGNORED):
        try:
            converted = msgspec.convert(raw, kind)
        except msgspec.ValidationError as exc:
            match = _UNKNOWN.match(str(exc))
            if match is None:
                raise
            name, path = match.group(1), match.group(2) or ""
            _container(raw, path).pop(name)
            ignored.append(_dotted(path, name))
            continue
        if ignored:
            log.info("unknown fields ignored", fields=ignored)
        return converted
    raise HttpError.invalid(f"more than {MAX_IGNORED} unknown fields", None)


def _dotted(path: str, name: str) -> str:
    return f"{path.lstrip('.')}.{name}".lstrip(".")


def _container(raw: Any, path: str) -> dict:
    """The object at a msgspec path such as `.messages[0]` (`` for the top level)."""
    for name, index in _STEP.findall(path):
        raw = raw[int(index)] if index else raw[name]
    return raw
