"""The replicas benchmark's pieces that need no server: the figures computed from what the
client measured (its workload and arrival times: tests/services/test_bench_workloads.py)."""

from benchmarks.serving.replicas import Sent, ratios, summarize


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
