"""Suffix decoding's lookup over one flat token array: the suffix tree, walked lazily.

A suffix tree of depth D over `tokens` has a node for every substring of up to D tokens, its
count the number of times that substring occurs; a draft walks down from the node of the
context's longest matching suffix, always to the most frequent child, while the product of
`count(child) / count(node)` stays above a threshold (Arctic Inference's `_speculate_path`).
The node of a substring is fully described by the set of positions where it ends, and its
children by the tokens that follow those positions, so this module computes exactly that walk
from the occurrences, with numpy, instead of keeping a tree: nothing to update as tokens
append (the executor's request table already holds every sequence's tokens) and no memory
beyond the tokens themselves. The price is one vectorised scan of the array per lookup
(about 0.2 ms per million tokens; benchmarks/engine/spec_decode.py measures the proposer).

`SEPARATOR` (-1) joins several sequences into one array (the global cache): no context token
equals it, so no match and no draft crosses from one sequence into the next.
"""

from dataclasses import dataclass, field

import numpy as np

SEPARATOR = -1
# the longest few distinct match lengths are tried as the draft's root (Arctic tries all)
NUM_MATCH_LENGTHS_TRIED = 3
SMALL = 64  # candidates few enough to compare over every column at once


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of the tokens' estimated probabilities
    match_len: int = 0
    ends: np.ndarray | None = None  # where the chosen matches end in the array


@dataclass(frozen=True)
class DraftLimits:
    max_tokens: int  # k: the most tokens a draft may have
    max_depth: int  # the longest suffix of the context matched
    max_spec_factor: float  # a draft has at most factor x match length tokens
    min_token_prob: float  # a draft stops before a token less likely than this


def match_ends(tokens: np.ndarray, context: np.ndarray, max_depth: int, ends=None):
    """Every position p of `tokens` where a suffix of `context` ends and a token follows,
    with the suffix's length (1..max_depth): int64 arrays ([num_matches], [num_matches]).
    `ends`: the positions before the last one that hold the context's last token, if known
    (an index); else they are found by a scan."""
    if ends is None:
        # the scalar in the array's own dtype: an int64 one would convert the whole array
        ends = np.flatnonzero(tokens[:-1] == tokens.dtype.type(context[-1]))
    ends = ends[tokens[ends + 1] != SEPARATOR]
    lengths = np.ones(ends.size, dtype=np.int64)
    depth = min(max_depth, len(context))
    backwards = context[::-1]  # backwards[b] is compared with tokens[end - b]
    alive, back = np.arange(ends.size), 1  # candidates whose match reaches column `back`
    # column by column while many candidates are alive (most drop out in the first few)...
    while back < depth and alive.size > SMALL:
        idx = ends[alive] - back
        alive = alive[(idx >= 0) & (tokens[np.maximum(idx, 0)] == backwards[back])]
        lengths[alive] += 1
        back += 1
    if back < depth and alive.size:  # ...then all remaining columns of the few at once
        idx = ends[alive, None] - np.arange(back, depth)  # [num_alive, depth - back]
        same = (idx >= 0) & (tokens[np.maximum(idx, 0)] == backwards[back:depth])
        lengths[alive] += np.cumprod(same, axis=1).sum(axis=1)
    return ends, lengths


def walk(tokens: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float) -> Draft:
    """Down the tree from the node whose occurrences end at `ends`: the most frequent next
    token (the most recent breaking ties) while the path's probability >= `min_prob`."""
    draft, prob, at = Draft(ends=ends), 1.0, ends
    while len(draft.token_ids) < max_tokens and at.size:
        if at.size == 1:  # one occurrence: its continuation, each token with p unchanged
            rest = tokens[int(at[0]) + 1 : int(at[0]) + 1 + max_tokens - len(draft.token_ids)]
            cut = np.flatnonzero(rest == SEPARATOR)
            rest = rest[: cut[0]] if cut.size else rest
            draft.token_ids += rest.tolist()
            draft.score += prob * len(rest)
            break
        nexts = at + 1
        nexts = nexts[nexts < len(tokens)]
        nexts = nexts[tokens[nexts] != SEPARATOR]
        if not nexts.size:
            break
        following = tokens[nexts[::-1]]  # latest first, so the first index is the latest
        values, first, counts = np.unique(following, return_index=True, return_counts=True)
        tied = np.flatnonzero(counts == counts.max())
        best = tied[np.argmin(first[tied])]
        prob *= counts[best] / at.size  # the node's count includes occurrences that end
        if prob < min_prob:
            break
        token = values[best]
        draft.token_ids.append(int(token))
        draft.score += prob
        at = nexts[tokens[nexts] == token]
    return draft


def best_draft(tokens: np.ndarray, context: np.ndarray, limits: DraftLimits, ends=None) -> Draft:
    """The best-scoring draft rooted at one of the longest matches of `context`'s suffixes in
    `tokens` (a longer match wins a tie); an empty Draft without a match. `ends` as for
    `match_ends`."""
    if len(tokens) < 2 or not len(context):
        return Draft()
    ends, lengths = match_ends(tokens, context, limits.max_depth, ends)
    best = Draft()
    for match_len in np.unique(lengths)[::-1][:NUM_MATCH_LENGTHS_TRIED]:
        num = min(limits.max_tokens, int(match_len * limits.max_spec_factor + 1e-6))
        if num <= best.score:  # a score is at most the draft's length: this cannot win
            continue
        draft = walk(tokens, ends[lengths >= match_len], num, limits.min_token_prob)
        if draft.score > best.score:
            draft.match_len = int(match_len)
            best = draft
    return best
