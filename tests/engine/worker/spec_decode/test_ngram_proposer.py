"""N-gram prompt lookup: the longest suffix match wins, its most recent occurrence next."""

import numpy as np
from kvpager.engine.worker.spec_decode.ngram_proposer import NgramProposer


def propose(tokens, k=3, low=1, high=3):
    return NgramProposer(low, high).propose(np.asarray(tokens, dtype=np.int64), k)


def test_longest_suffix_match_proposes_what_followed():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    # "2 3" matches at 1..2 (followed by 7), "3" alone more recently (followed by 8)
    assert propose([5, 2, 3, 7, 3, 8, 2, 3]) == [7, 3, 8]


def test_ties_go_to_the_most_recent_and_proposals_stop_at_the_end():
    assert propose([7, 1, 8, 8, 1, 2, 3, 1], k=2) == [2, 3]
    assert propose([4, 4, 4], k=5) == [4]  # "4 4" at 0..1: one token follows it


def test_no_match_or_too_short_proposes_nothing():
    assert propose([5, 6, 7]) == []
    assert propose([5, 6, 5, 6, 9, 6], low=2) == []  # "9 6" never occurred before
    assert propose([1]) == [] and propose([3, 3], k=0) == []
