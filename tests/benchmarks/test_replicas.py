"""The replicas benchmark's pieces that need no server: its workload, arrival times, and the
figures computed from what the client measured."""

import math

from benchmarks.replicas import Sent, ratios, summarize
from benchmarks.workloads import TokenSource, arrival_times, multi_prefix


def test_multi_prefix_interleaves_systems_each_with_its_users():
    source = TokenSource(vocab_size=500, special_ids=frozenset(range(10)))
    workload = multi_prefix(source, 3, 4, 32, (5, 9), 7, seed=1)
    assert workload == multi_prefix(source, 3, 4, 32, (5, 9), 7, seed=1)
    assert len(workload.requests) == 12 and {r.max_tokens for r in workload.requests} == {7}
    systems = [tuple(r.prompt_token_ids[:32]) for r in workload.requests]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert all(5 <= len(r.prompt_token_ids) - 32 <= 9 for r in workload.requests)
    assert all(10 <= t < 500 for r in workload.requests for t in r.prompt_token_ids)
    assert systems != sorted(systems, key=systems.index)  # not grouped by system: shuffled


def test_arrival_times_are_seeded_poisson_or_all_at_once():
    times = arrival_times(2000, rate=4.0, seed=3)
    assert times == arrival_times(2000, rate=4.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert 0.9 < len(times) / times[-1] / 4.0 < 1.1  # about 4 requests a second
    assert arrival_times(5, math.inf, seed=3) == [0.0] * 5


def test_summary_and_ratios_from_measured_requests():
    sent = [Sent(0.0, 0.5, 2.0, 100, 64, 10), Sent(1.0, 1.1, 4.0, 100, 0, 10)]
    summary = summarize(sent)
    assert summary["elapsed_s"] == 4.0 and summary["output_tokens_per_s"] == 5.0
    assert summary["prefix_hit_rate"] == 0.32
    assert summary["ttft_ms_p50"] == 300.0  # between 100 ms and 500 ms
    rows = [
        {"config": "1 instance", "rate": "inf", "ttft_ms_p50": 900, "output_tokens_per_s": 50},
        {"config": "2 x kv", "rate": "inf", "ttft_ms_p50": 300, "output_tokens_per_s": 90},
        {"config": "2 x round-robin", "rate": "inf", "ttft_ms_p50": 600},
    ]
    for row in rows:
        row.setdefault("ttft_ms_p90", row["ttft_ms_p50"])
    [line] = ratios(rows, replicas=2)
    assert line["kv / round-robin TTFT p50"] == 0.5
    assert line["2 / 1 instances out tok/s"] == 1.8
    assert "kv / least-loaded TTFT p50" not in line  # not run
