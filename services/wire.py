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


# Room for the NATS headers and the subject beside a payload: the server's `max_payload`
# counts headers and body together.
PAYLOAD_HEADROOM = 1024
DEFAULT_MAX_PAYLOAD = 1 << 20  # nats-server's default


def payload_budget(nc: Any) -> int:
    """The most bytes one internal message may encode to on this connection: the server's
    `max_payload` (learnt at connect) less headroom. Before a connect, the server default."""
    max_payload = getattr(nc, "max_payload", 0) or DEFAULT_MAX_PAYLOAD
    return max(1, max_payload - PAYLOAD_HEADROOM)


def pack_within(items: list[Any], budget: int, overhead: int = 64) -> list[list[Any]]:
    """`items` cut into consecutive runs whose packed sizes add up to at most `budget` (less
    `overhead` for the message around them). An item over the budget on its own goes alone:
    the caller checks it (it cannot be cut here)."""
    runs: list[list[Any]] = [[]]
    used = 0
    for item in items:
        size = len(_msgpack.encode(item))
        if runs[-1] and used + size > budget - overhead:
            runs.append([])
            used = 0
        runs[-1].append(item)
        used += size
    return [run for run in runs if run]
