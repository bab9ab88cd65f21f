"""Prompt pieces whose AddRequest never comes are dropped (a tokenizer died in between)."""

from services.scheduler.pieces import PromptPieces


def test_pieces_join_in_order_and_are_taken_once():
    pieces = PromptPieces(ttl_s=30.0)
    pieces.add("a", [1, 2], now=0.0)
    pieces.add("a", [3], now=1.0)
    assert pieces.take("a", now=2.0) == [1, 2, 3]
    assert pieces.take("a", now=2.0) == [] and len(pieces) == 0


def test_orphaned_pieces_are_dropped_after_the_ttl():
    pieces = PromptPieces(ttl_s=30.0)
    pieces.add("orphan", [1, 2, 3], now=0.0)
    pieces.add("live", [4], now=25.0)
    pieces.add("live", [5], now=31.0)  # a new piece drops the orphan, not the live request
    assert len(pieces) == 1
    assert pieces.take("orphan", now=31.0) == []
    assert pieces.take("live", now=40.0) == [4, 5]
    pieces.add("late", [6], now=100.0)
    assert pieces.drop_stale(now=131.0) == ["late"] and len(pieces) == 0
