"""Encoding on the wire: msgpack inside, JSON (or msgpack when asked) to clients."""

from typing import Any

import msgspec

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
