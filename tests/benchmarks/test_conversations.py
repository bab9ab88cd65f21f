"""The conversation benchmark's pieces that need no server: its seeded conversations and the
figures computed from what the client measured."""

from types import SimpleNamespace

from kvpager.engine.kv.kv_size import parse_bytes

from benchmarks.serving.conversations import (
    Turn,
    conversations,
    max_context,
    parse_args,
    ratios,
    summarize,
    vllm_args,
)
from benchmarks.serving.token_clients import _token_ids


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
    turns = [Turn(0, 0.5, 4, 0), Turn(0, 0.7, 4, 0), Turn(1, 0.1, 4, 32, 32), Turn(1, 0.3, 4, 16)]
    stats = SimpleNamespace(
        num_disk_stored_blocks=5, num_disk_loaded_blocks=3, num_disk_failed_loads=0,
        num_disk_prefetched_blocks=2, num_disk_prefetch_dropped_blocks=1, block_size=16,
    )  # fmt: skip
    summary = summarize(turns, 2.0, stats)
    assert summary["ttft_first"] == "600 / 700 ms" and summary["ttft_later"] == "200 / 300 ms"
    assert summary["tokens_per_s"] == 8.0 and summary["cached_tokens"] == 48
    assert summary["disk"] == (
        "stored 5, loaded 3 (prefetched 2, dropped 1), hit 2, failed 0 blocks"
    )


def test_vllm_gets_the_device_budget_or_the_device_and_cpu_budgets():
    args = parse_args(["--kv-cache-memory", "512MiB", "--swap-space", "256MiB"])
    same = vllm_args(args)
    assert parse_bytes(same.kv_cache_memory) == 512 << 20
    assert same.max_model_len == max_context(args) + 8 and same.vllm_python == args.vllm_python
    both = vllm_args(parse_args(["--swap-space", "256MiB", "--vllm-kv", "device+cpu"]))
    assert parse_bytes(both.kv_cache_memory) == 768 << 20
    assert args.kv_cache_memory == "512MiB"  # the kvpager modes' own budget untouched


def test_ratios_compare_each_kvpager_mode_with_vllm():
    def result(tokens_per_s, first_s, later_s):
        return {
            "tokens_per_s": tokens_per_s,
            "ttft_first_p50_s": first_s,
            "ttft_later_p50_s": later_s,
        }

    results = {"disk": result(20.0, 1.0, 0.5), "vllm": result(8.0, 2.0, 2.5)}
    (line,) = ratios(results)
    assert "2.50x throughput" in line and "5.00x lower returning TTFT p50" in line
    assert "2.00x lower first-turn TTFT p50" in line and line.strip().startswith("disk / vllm")
    assert ratios({"disk": results["disk"]}) == []  # no vLLM run: nothing to compare


def test_streamed_vllm_chunks_give_their_token_ids():
    chunk = SimpleNamespace(choices=[SimpleNamespace(token_ids=[5, 6])])
    assert _token_ids(chunk) == [5, 6]
    assert _token_ids(SimpleNamespace(choices=[])) == []  # the usage chunk
    assert _token_ids(SimpleNamespace(choices=[SimpleNamespace(token_ids=None)])) == []
