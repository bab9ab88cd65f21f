"""The gateway's stored responses (`store: true`): what `GET /v1/responses/{id}` returns and
what `previous_response_id` continues, in this process's memory.

Bounded three ways: at most `max_entries` responses and `max_bytes` of their JSON (the oldest
go first), and each for `ttl_s` seconds. Every entry has an owner, the API key's cache salt
(services/http/guard.py; "" on a gateway without keys): another owner's lookup finds nothing,
exactly as an unknown id, so ids never tell one key about another's responses. An owner keeps
at most `max_per_owner` (its own oldest go first), so that one key's flood cannot push every
other key's conversations out.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from kvpager.schemas.openai import Message

log = structlog.get_logger(__name__)


class StoredResponse(msgspec.Struct):
    """A response and its whole conversation as chat turns (without the instructions)."""

    response: dict[str, Any]
    turns: list[Message]


@dataclass
class _Entry:
    owner: str
    data: bytes  # a StoredResponse's JSON: its size is what the bound counts
    expires_at: float


class ResponseStore:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        max_per_owner: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_entries >= 1 and max_bytes >= 1 and ttl_s > 0, (max_entries, max_bytes, ttl_s)
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.max_per_owner = max_entries if max_per_owner is None else max_per_owner
        assert self.max_per_owner >= 1, self.max_per_owner
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._by_owner: dict[str, OrderedDict[str, None]] = {}  # each owner's ids, oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> bool:
        """Keep `stored`, evicting the oldest past the bounds; False if it alone is too big."""
        data = msgspec.json.encode(stored)
        if len(data) > self.max_bytes:
            log.warning("response not stored: over the store's bytes", response_id=response_id,
                        num_bytes=len(data), max_bytes=self.max_bytes)  # fmt: skip
            return False
        self._drop(response_id)
        self._entries[response_id] = _Entry(owner, data, self._clock() + self.ttl_s)
        owned = self._by_owner.setdefault(owner, OrderedDict())
        owned[response_id] = None
        self.num_bytes += len(data)
        while len(owned) > self.max_per_owner:
            self._drop(next(iter(owned)))
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The response `owner` stored as `response_id`; None if unknown, expired or not
        theirs."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return msgspec.json.decode(entry.data, type=StoredResponse)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget `owner`'s `response_id`; False if there was none of theirs."""
        if await self.get(owner, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        """Entries expire in the order they came (one TTL for all): drop from the front."""
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.num_bytes -= len(entry.data)
        owned = self._by_owner[entry.owner]
        del owned[response_id]
        if not owned:
            del self._by_owner[entry.owner]
