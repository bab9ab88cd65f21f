"""PinTable: prompt-cache blocks kept for a time (Anthropic's `cache_control` as a retention
contract, GenerateRequest.cache).

A pinned device block carries an expiry on a monotonic clock (injectable, for tests). The pool
(engine/kv/block_pool.py) keeps free pinned blocks in a queue of their own and evicts them only
when no unpinned free block is left; an evicted pin's content goes down the tiers as any cached
block's does (CPU pool, then disk: below the device every tier is LRU). Its pin is kept by hash
(`demoted`, at most as many as the CPU pool has blocks): when the content comes back to the
device before the pin would have ended, the block is pinned again. A hit on a pinned block
refreshes its expiry (as Anthropic's cache does); an expired pin makes its block an ordinary
LRU entry again.

Bounds: at most `max_pinned` blocks pinned at once (`--max-pinned-fraction` of the device's),
and at most `max_per_key` per key (the request's `cache_salt`, which the HTTP gateway sets per
API key; 0: no per-key bound but the total). The block manager asks for room for a request's
whole prefix at once: a request over its quota runs unpinned (engine/kv/block_manager.py).
"""

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class Pin:
    until: float  # the clock's time the pin ends
    ttl: float  # seconds a hit extends it by
    key: str | None  # whose quota it counts against (a cache_salt)


class PinTable:
    """Which device blocks are pinned, until when, and for whom; counts per key."""

    def __init__(self, max_pinned: int, max_per_key: int = 0, clock: Clock = time.monotonic):
        self.max_pinned = max_pinned
        self.max_per_key = max_per_key
        self.clock = clock
        self.pins: dict[int, Pin] = {}  # device block id -> its pin
        self.per_key: dict[str | None, int] = {}
        self._expiries: list[tuple[float, int]] = []  # heap; entries of refreshed pins go stale
        self.demoted: OrderedDict[bytes, Pin] = OrderedDict()  # pins of content gone to CPU
        self.num_pinned_evictions = 0  # pinned blocks that pressure (not expiry) evicted
        self.num_restored = 0  # pins that came back with their content

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.pins

    @property
    def num_pinned(self) -> int:
        return len(self.pins)

    def room(self, key: str | None) -> int:
        """Blocks `key` may pin now, within the total and its own quota."""
        room = self.max_pinned - len(self.pins)
        if self.max_per_key:
            room = min(room, self.max_per_key - self.per_key.get(key, 0))
        return max(0, room)

    def pin(self, block_id: int, ttl: float, key: str | None) -> bool:
        """Pin a block for `ttl` seconds from now; True if it was not pinned before (a cache
        write), False if its pin was only extended. The caller checked `room`."""
        until = self.clock() + ttl
        pin = self.pins.get(block_id)
        if pin is not None:
            if until > pin.until:
                pin.until, pin.ttl = until, max(pin.ttl, ttl)
                heapq.heappush(self._expiries, (until, block_id))
            return False
        assert self.room(key) > 0, f"block {block_id}: pinned past the bounds"
        self.pins[block_id] = Pin(until, ttl, key)
        self.per_key[key] = self.per_key.get(key, 0) + 1
        heapq.heappush(self._expiries, (until, block_id))
        return True

    def refresh(self, block_id: int) -> None:
        """A hit: the pin lasts its ttl from now."""
        pin = self.pins.get(block_id)
        if pin is not None:
            self.pin(block_id, pin.ttl, pin.key)

    def unpin(self, block_id: int) -> None:
        pin = self.pins.pop(block_id, None)
        if pin is None:
            return
        self.per_key[pin.key] -= 1
        if not self.per_key[pin.key]:
            del self.per_key[pin.key]

    def demote(self, block_id: int, block_hash: bytes, max_entries: int) -> None:
        """The pinned block's content went to the CPU pool: keep its pin by hash (the oldest
        such pins are forgotten past `max_entries`)."""
        pin = self.pins.get(block_id)
        if pin is None or max_entries <= 0:
            return
        self.demoted[block_hash] = pin
        self.demoted.move_to_end(block_hash)
        while len(self.demoted) > max_entries:
            self.demoted.popitem(last=False)

    def restore(self, block_id: int, block_hash: bytes) -> bool:
        """Content cached on the device again: pin its block anew if its pin had not ended
        (for its TTL from now, as a hit) and its key has room; True if so."""
        pin = self.demoted.pop(block_hash, None)
        if pin is None or pin.until <= self.clock() or not self.room(pin.key):
            return False
        self.pin(block_id, pin.ttl, pin.key)
        self.num_restored += 1
        return True

    def take_expired(self) -> list[int]:
        """Unpin the blocks whose pins have ended; returns them."""
        now, expired = self.clock(), []
        while self._expiries and self._expiries[0][0] <= now:
            until, block_id = heapq.heappop(self._expiries)
            pin = self.pins.get(block_id)
            if pin is not None and pin.until == until:  # else a stale entry: refreshed since
                self.unpin(block_id)
                expired.append(block_id)
        return expired

    def wall_until(self, block_id: int) -> float | None:
        """When the block's pin ends, in unix time (for KV events), or None if unpinned."""
        pin = self.pins.get(block_id)
        return None if pin is None else time.time() + (pin.until - self.clock())

    def check_invariants(self) -> None:
        counts: dict[str | None, int] = {}
        for pin in self.pins.values():
            counts[pin.key] = counts.get(pin.key, 0) + 1
        assert counts == self.per_key, "pins per key disagree with the pins"
        assert len(self.pins) <= self.max_pinned, "more blocks pinned than the bound"
