"""The conversation benchmark's pieces that need no server: its seeded conversations and the
figures computed from what the client measured."""

from types import SimpleNamespace

from benchmarks.serving.conversations import Turn, conversations, max_context, parse_args, summarize


def test_conversations_are_seeded_and_sized():
    args = parse_args(["--conversations", "3", "--first-tokens", "20", "--turns", "4"])
    convs = conversations(args, vocab=500)
    assert [c.token_ids for c in convs] == [c.token_ids for c in conversations(args, 500)]
    assert len(convs) == 3 and {len(c.token_ids) for c in convs} == {20}
    assert len({tuple(c.token_ids) for c in convs}) == 3
    assert all(100 <= t < 500 for c in convs for t in c.token_ids)
    # 20 tokens, 3 more turns of 128 + 32, and the last answer
    assert max_context(args) == 20 + 3 * (128 + 32) + 32


def test_summary_splits_first_and_later_turns():
    turns = [Turn(0, 0.5, 4, 0), Turn(0, 0.7, 4, 0), Turn(1, 0.1, 4, 32), Turn(1, 0.3, 4, 16)]
    stats = SimpleNamespace(
        num_disk_stored_blocks=5, num_disk_loaded_blocks=3, num_disk_failed_loads=0
    )
    summary = summarize(turns, 2.0, stats)
    assert summary["ttft_first"] == "600 / 700 ms" and summary["ttft_later"] == "200 / 300 ms"
    assert summary["tokens_per_s"] == 8.0 and summary["cached_tokens"] == 48
    assert summary["disk"] == "stored 5, loaded 3, failed 0 blocks"
