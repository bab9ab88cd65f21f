"""Suffix decoding's global cache: the outputs of earlier requests, bounded, LRU evicted.

Agent loops rewrite the same file turn after turn: the tokens a request is about to produce
were often produced by an earlier request, whose output is not in this one's tokens. The
cache keeps the last `max_requests` outputs (the least recently used, by insertion or by a
draft taken from it, evicted first) in one flat int32 array, each followed by SEPARATOR, the
form suffix_match.py reads: with the index below, 12 bytes a cached token (10,000 outputs of
1,000 tokens: 120 MB).

A lookup needs the positions holding the context's last token. Scanning the whole array for
them costs ~0.2-1 ms per million tokens, a sequence a step; so the array's older part is
indexed (its positions sorted by token: a binary search, then the matches only) and only the
part appended since is scanned. The index is rebuilt once that part outgrows a quarter of
the indexed one (amortised O(log n) a token). An evicted output is overwritten with
SEPARATOR in place (the index's stale entries are filtered out); the array is compacted
when the dead tokens outnumber the live ones.
"""

from collections import OrderedDict

import numpy as np
from kvpager.engine.worker.spec_decode.suffix_match import SEPARATOR

MIN_UNINDEXED = 1 << 16  # tokens appended before an index is worth building


class SuffixCache:
    def __init__(self, max_requests: int) -> None:
        assert max_requests >= 0, "max cached requests"
        self.max_requests = max_requests
        self._where: OrderedDict[str, tuple[int, int]] = OrderedDict()  # LRU first: (start, len)
        self._buffer = np.zeros(1024, dtype=np.int32)
        self._size = 0  # tokens in use, dead ones included
        self._num_dead = 0
        self._num_indexed = 0  # positions [0, this) are in the index
        self._order = np.zeros(0, dtype=np.int32)  # those positions, sorted by token (stable)
        self._sorted = np.zeros(0, dtype=np.int32)  # their tokens, sorted
        self._starts: list[int] = []  # where each appended output starts, ascending
        self._owners: list[str] = []  # whose output starts there
        self._starts_array = np.zeros(0, dtype=np.int64)  # _starts, for searching

    def __len__(self) -> int:
        return len(self._where)

    def add(self, seq_id: str, output_token_ids: np.ndarray) -> None:
        """Cache a finished (or preempted: the later, longer output replaces it) output."""
        if self.max_requests == 0 or not len(output_token_ids):
            return
        self._evict(seq_id)
        while len(self._where) >= self.max_requests:
            self._evict(next(iter(self._where)))
        self._append(seq_id, np.asarray(output_token_ids, dtype=np.int32))
        if self._num_dead > self._size - self._num_dead:
            self._compact()
        unindexed = self._size - self._num_indexed
        if unindexed > max(MIN_UNINDEXED, self._num_indexed // 4):
            self._reindex()

    def tokens(self) -> np.ndarray:
        """int32 [num_tokens]: every cached output, each followed by SEPARATOR (and evicted
        ones overwritten by it)."""
        return self._buffer[: self._size]

    def ends_of(self, token_id: int) -> np.ndarray:
        """Ascending positions of `tokens()` that hold `token_id` (int64)."""
        token = np.int32(token_id)
        low = np.searchsorted(self._sorted, token, side="left")
        high = np.searchsorted(self._sorted, token, side="right")
        indexed = self._order[low:high].astype(np.int64)
        indexed = indexed[self._buffer[indexed] == token]  # evicted since indexing
        recent = self._buffer[self._num_indexed : self._size]
        return np.concatenate([indexed, self._num_indexed + np.flatnonzero(recent == token)])

    def touch(self, positions: np.ndarray) -> None:
        """Mark the outputs holding these positions of `tokens()` as recently used."""
        if not positions.size:
            return
        if len(self._starts_array) != len(self._starts):
            self._starts_array = np.asarray(self._starts, dtype=np.int64)
        owners = np.unique(np.searchsorted(self._starts_array, positions, side="right") - 1)
        for owner in owners.tolist():
            seq_id, start = self._owners[owner], self._starts[owner]
            if self._where.get(seq_id, (None,))[0] == start:  # not evicted since
                self._where.move_to_end(seq_id)

    def _append(self, seq_id: str, output: np.ndarray) -> None:
        needed = self._size + len(output) + 1
        if needed > len(self._buffer):
            grown = np.zeros(max(needed, 2 * len(self._buffer)), dtype=np.int32)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        start = self._size
        self._buffer[start : start + len(output)] = output
        self._buffer[start + len(output)] = SEPARATOR
        self._size = needed
        self._where[seq_id] = (start, len(output))
        self._starts.append(start)
        self._owners.append(seq_id)

    def _evict(self, seq_id: str) -> None:
        where = self._where.pop(seq_id, None)
        if where is not None:
            start, length = where
            self._buffer[start : start + length] = SEPARATOR
            self._num_dead += length + 1

    def _compact(self) -> None:
        live = [(seq_id, self._buffer[s : s + n].copy()) for seq_id, (s, n) in self._where.items()]
        self._where.clear()
        self._size = self._num_dead = self._num_indexed = 0
        self._starts, self._owners = [], []
        for seq_id, output in live:  # LRU order kept
            self._append(seq_id, output)
        self._reindex()

    def _reindex(self) -> None:
        order = np.argsort(self._buffer[: self._size], kind="stable")
        self._sorted = self._buffer[: self._size][order]
        self._order = order.astype(np.int32)  # positions fit: 12 bytes a token with the tokens
        self._num_indexed = self._size
