"""The agent-conversation benchmark's pieces that need no server: its seeded conversations and
the figures computed from what the client measured."""

from kvpager.schemas.public import Usage

from benchmarks.serving.agent_conversations import (
    Turn,
    conversations,
    parse_args,
    summarize,
    system_prompt,
)


def test_agents_share_a_seeded_system_prompt_with_its_tools():
    args = parse_args(["--conversations", "5", "--agents", "2", "--system-words", "30"])
    convs = conversations(args)
    systems = [c.messages[0]["content"] for c in convs]
    assert systems == [system_prompt(args, i % 2) for i in range(5)]
    assert systems[0] != systems[1] and '"name": "tool_0_7"' in systems[0]
    assert all(c.messages[0]["role"] == "system" and len(c.messages) == 1 for c in convs)


def test_summary_splits_turns_and_counts_reads_writes_and_tiers():
    def turn(turn_idx, ttft, prompt, cached, tiers, pinned=0):
        usage = Usage(
            num_prompt_tokens=prompt,
            num_completion_tokens=4,
            num_cached_prompt_tokens=cached,
            num_cache_write_tokens=pinned,
            cached_tokens_by_tier=tiers,
        )
        return Turn(0, turn_idx, ttft, usage)

    turns = [
        turn(0, 0.5, 100, 0, {}, pinned=96),
        turn(1, 0.1, 150, 96, {"device": 96}),
        turn(1, 0.3, 150, 64, {"device": 32, "cpu": 32}),
    ]
    summary = summarize(turns, [0.2, 0.4], 3.0)
    assert summary["ttft_first_p50_ms"] == 500 and summary["ttft_later_p50_ms"] == 300
    assert summary["cache_read_tokens"] == 160 and summary["cache_write_tokens"] == 240
    assert summary["read_write_ratio"] == 160 / 240 and summary["pinned_write_tokens"] == 96
    assert summary["read_tokens_by_tier"] == {"device": 128, "cpu": 32}
    assert summary["flood_requests"] == 2
