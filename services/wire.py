"""Encoding on the wire: msgpack inside, JSON (or msgpack when asked) to clients."""

from typing import Any

import msgspec
import structlog

log = structlog.get_logger(__name__)

MSGPACK_HEADERS = {"Content-Type": "application/msgpack"}

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()


def pack(message: Any) -> bytes:
    """Internal messages: msgpack."""
    return _msgpack.encode(message)


def encode_public(message: Any, msgpack: bool) -> tuple[bytes, dict[str, str] | None]:
    """A client-facing message in the encoding its request used, with the matching header."""
    if msgpack:
        return _msgpack.encode(message), MSGPACK_HEADERS
    return _json.encode(message), None


def unpack(decoder: msgspec.msgpack.Decoder, data: bytes, subject: str) -> Any | None:
    """An internal message, or None (logged) when it does not decode or validate: nothing on
    the wire is trusted, internal subjects included, and one bad message must not end the
    callback that reads them all."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        log.error("undecodable message: dropped", subject=subject, error=str(exc)[:200])
        return None
