"""Long token lists cut into pieces that travel ahead of their message, and joined again.

One rule for both hops that carry them (tokenizer -> scheduler: PromptPieces before an
AddRequest; scheduler -> executor: StepPieces before a RunStep): `split` leaves the message at
most `keep` of the ids, its list's tail, and sends everything before it ahead in pieces of
`size`. `Pieces` joins them on arrival, by id, and forgets what waits too long (the sender
died between the pieces and its message) or would hold more than `max_tokens` ids in all
(nothing on the wire is trusted: pieces with no message to follow must not grow without end).

    ids:    [ piece 0: size | piece 1: size | piece 2: <= size | message: <= keep ]
"""

import time

import structlog

log = structlog.get_logger(__name__)


def split(token_ids: list[int], size: int, keep: int) -> tuple[list[list[int]], list[int]]:
    """The pieces to send ahead, and the tail (at most `keep` ids) the message itself carries."""
    assert size >= 1 and keep >= 0, "pieces hold at least one id"
    num_head = max(0, len(token_ids) - keep)
    head = token_ids[:num_head]
    pieces = [head[start : start + size] for start in range(0, num_head, size)]
    return pieces, token_ids[num_head:]


class Pieces:
    """Pieces received, by the id of the message they precede."""

    def __init__(self, ttl_s: float, max_tokens: int) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self._token_ids: dict[str, list[int]] = {}
        self._last_at: dict[str, float] = {}
        self._num_tokens = 0

    def __len__(self) -> int:
        return len(self._token_ids)

    def __bool__(self) -> bool:
        return bool(self._token_ids)

    def add(self, key: str, token_ids: list[int], now: float | None = None) -> bool:
        """Hold a piece; False (and nothing held) when all pieces would pass `max_tokens`."""
        now = time.monotonic() if now is None else now
        self.drop_stale(now)
        if self._num_tokens + len(token_ids) > self.max_tokens:
            log.error("pieces beyond their bound: dropped", key=key, max_tokens=self.max_tokens)
            self._forget(key)
            return False
        self._token_ids.setdefault(key, []).extend(token_ids)
        self._last_at[key] = now
        self._num_tokens += len(token_ids)
        return True

    def take(self, key: str, now: float | None = None) -> list[int]:
        """The pieces of `key` in order (none: []), forgotten here."""
        self.drop_stale(time.monotonic() if now is None else now)
        return self._forget(key)

    def clear(self) -> None:
        self._token_ids.clear()
        self._last_at.clear()
        self._num_tokens = 0

    def drop_stale(self, now: float) -> list[str]:
        """Forget the ids whose last piece is older than ttl_s; returns them."""
        stale = [key for key, at in self._last_at.items() if now - at > self.ttl_s]
        for key in stale:
            self._forget(key)
        return stale

    def _forget(self, key: str) -> list[int]:
        self._last_at.pop(key, None)
        token_ids = self._token_ids.pop(key, [])
        self._num_tokens -= len(token_ids)
        return token_ids
