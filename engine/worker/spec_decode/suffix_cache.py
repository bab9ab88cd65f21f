"""Suffix decoding's global cache: the outputs of earlier requests, bounded, LRU evicted.

Agent loops rewrite the same file turn after turn: the tokens a request is about to produce
were often produced by an earlier request, whose output is not in this one's tokens. The
cache keeps the last `max_requests` outputs (the least recently used, by insertion or by a
draft taken from it, evicted first) joined into one flat array with separators, the form
suffix_match.py reads; the array is rebuilt lazily, at the first lookup after a change. Tokens
are kept as int32 (every vocabulary fits): memory is 4 bytes a cached token, the bound
`max_requests` x the longest output.
"""

from collections import OrderedDict

import numpy as np
from kvpager.engine.worker.spec_decode.suffix_match import SEPARATOR


class SuffixCache:
    def __init__(self, max_requests: int) -> None:
        assert max_requests >= 0, "max cached requests"
        self.max_requests = max_requests
        self._outputs: OrderedDict[str, np.ndarray] = OrderedDict()  # least recent first
        self._tokens: np.ndarray | None = None  # None: rebuild at the next lookup
        self._seq_ids: list[str] = []  # in the flat array's order
        self._starts = np.zeros(0, dtype=np.int64)  # where each output starts in it

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, seq_id: str, output_token_ids: np.ndarray) -> None:
        """Cache a finished (or preempted: the later, longer output replaces it) output."""
        if self.max_requests == 0 or not len(output_token_ids):
            return
        self._outputs.pop(seq_id, None)
        self._outputs[seq_id] = np.asarray(output_token_ids, dtype=np.int32).copy()
        while len(self._outputs) > self.max_requests:
            self._outputs.popitem(last=False)
        self._tokens = None

    def tokens(self) -> np.ndarray:
        """int32 [num_tokens]: every cached output, each followed by SEPARATOR."""
        if self._tokens is None:
            self._seq_ids = list(self._outputs)
            separator = np.full(1, SEPARATOR, dtype=np.int32)
            parts = [part for out in self._outputs.values() for part in (out, separator)]
            self._tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
            lengths = [len(out) + 1 for out in self._outputs.values()]
            self._starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
        return self._tokens

    def touch(self, positions: np.ndarray) -> None:
        """Mark the outputs holding these positions of `tokens()` as recently used."""
        if not positions.size:
            return
        owners = np.unique(np.searchsorted(self._starts, positions, side="right") - 1)
        for owner in owners:
            seq_id = self._seq_ids[owner]
            if seq_id in self._outputs:
                self._outputs.move_to_end(seq_id)
