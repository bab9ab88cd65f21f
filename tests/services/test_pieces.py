"""Long token lists in pieces (services/pieces.py), one rule for both hops: the message keeps
at most `keep` ids of its tail; pieces whose message never comes are dropped after a while,
and no more than `max_tokens` ids are ever held."""

import pytest
from kvpager.services.pieces import Pieces, split


@pytest.mark.parametrize(
    "length,size,keep,pieces,tail",
    [
        (3, 4, 4, [], 3),  # fits: no pieces
        (4, 4, 4, [], 4),
        (5, 4, 4, [1], 4),
        (9, 4, 4, [4, 1], 4),  # the message keeps its tail
        (12, 4, 4, [4, 4], 4),
        (10, 4, 0, [4, 4, 2], 0),  # no room left in the message: every id goes ahead
        (10, 4, 3, [4, 3], 3),
    ],
)
def test_split_keeps_the_tail_and_sends_the_rest_ahead(length, size, keep, pieces, tail):
    ids = list(range(length))
    head, kept = split(ids, size, keep)
    assert [len(p) for p in head] == pieces and len(kept) == tail
    assert [t for p in head for t in p] + kept == ids


def test_pieces_join_in_order_and_are_taken_once():
    pieces = Pieces(ttl_s=30.0, max_tokens=100)
    pieces.add("a", [1, 2], now=0.0)
    pieces.add("a", [3], now=1.0)
    assert pieces.take("a", now=2.0) == [1, 2, 3]
    assert pieces.take("a", now=2.0) == [] and len(pieces) == 0


def test_orphaned_pieces_are_dropped_after_the_ttl():
    pieces = Pieces(ttl_s=30.0, max_tokens=100)
    pieces.add("orphan", [1, 2, 3], now=0.0)
    pieces.add("live", [4], now=25.0)
    pieces.add("live", [5], now=31.0)  # a new piece drops the orphan, not the live request
    assert len(pieces) == 1
    assert pieces.take("orphan", now=31.0) == []
    assert pieces.take("live", now=40.0) == [4, 5]
    pieces.add("late", [6], now=100.0)
    assert pieces.drop_stale(now=131.0) == ["late"] and len(pieces) == 0


def test_pieces_past_the_bound_are_refused_and_their_id_forgotten():
    pieces = Pieces(ttl_s=30.0, max_tokens=5)
    assert pieces.add("a", [1, 2, 3], now=0.0)
    assert pieces.add("b", [4], now=0.0)
    assert not pieces.add("a", [5, 6], now=0.0)  # 6 > 5: a's pieces go, b's stay
    assert pieces.take("a", now=0.0) == [] and pieces.take("b", now=0.0) == [4]
    assert pieces.add("c", [1, 2, 3, 4, 5], now=0.0)  # the freed room is free again
