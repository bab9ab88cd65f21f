"""Token ids of long prompts, which travel ahead of their AddRequest in PromptPieces.

A tokenizer sends a request's pieces and then its AddRequest back to back; if it dies in
between, the AddRequest never comes. Pieces older than `ttl_s` are dropped then, so a dead
tokenizer cannot leak the scheduler's memory.
"""

import time


class PromptPieces:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._token_ids: dict[str, list[int]] = {}
        self._last_at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._token_ids)

    def add(self, request_id: str, token_ids: list[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.drop_stale(now)
        self._token_ids.setdefault(request_id, []).extend(token_ids)
        self._last_at[request_id] = now

    def take(self, request_id: str, now: float | None = None) -> list[int]:
        """The pieces of `request_id` (none: []), forgotten here."""
        self.drop_stale(time.monotonic() if now is None else now)
        self._last_at.pop(request_id, None)
        return self._token_ids.pop(request_id, [])

    def drop_stale(self, now: float) -> list[str]:
        """Forget requests whose last piece is older than ttl_s; returns their ids."""
        stale = [rid for rid, at in self._last_at.items() if now - at > self.ttl_s]
        for request_id in stale:
            del self._last_at[request_id]
            del self._token_ids[request_id]
        return stale
