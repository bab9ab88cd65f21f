"""`kvpager bench serve`'s figures against values worked out by hand."""

import pytest
from kvpager.services.bench.metrics import RequestOutcome, format_summary, serve_summary

approx = pytest.approx


def _outcomes() -> list[RequestOutcome]:
    return [
        # 3 tokens in 3 chunks: TTFT 100 ms, latency 700 ms, TPOT 600 / 2 = 300 ms, ITL 200, 300
        RequestOutcome(4, sent_at=0.0, chunk_times=[0.1, 0.3, 0.6], num_output_tokens=3,
                       done_at=0.7),
        # 4 tokens in 2 chunks: TTFT 500 ms, latency 600 ms, TPOT 100 / 3 ms, ITL 100
        RequestOutcome(6, sent_at=1.0, chunk_times=[1.5, 1.6], num_output_tokens=4, done_at=1.6),
        # refused: counted as failed, no tokens, no latencies
        RequestOutcome(5, sent_at=0.0, done_at=0.2, error="overloaded"),
    ]  # fmt: skip


def test_counts_and_throughput():
    summary = serve_summary(_outcomes(), duration_s=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (10, 7)
    assert summary["request_throughput"] == approx(1.0)
    assert summary["output_throughput"] == approx(3.5)
    assert summary["total_token_throughput"] == approx(8.5)
    assert summary["errors"] == ["overloaded"]


def test_latency_statistics_in_ms():
    summary = serve_summary(_outcomes(), duration_s=2.0)
    # p99 of two values a, b (numpy's linear interpolation): a + 0.99 (b - a)
    expected = {
        "ttft": (300.0, 300.0, 100 + 0.99 * 400),
        "tpot": ((300 + 100 / 3) / 2, (300 + 100 / 3) / 2, 100 / 3 + 0.99 * (300 - 100 / 3)),
        "itl": (200.0, 200.0, 200 + 0.98 * 100),  # [100, 200, 300]: rank 1.98
        "e2el": (650.0, 650.0, 600 + 0.99 * 100),
    }
    for name, (mean, median, p99) in expected.items():
        got = [summary[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99")]
        assert got == approx([mean, median, p99]), name


def test_one_token_has_no_tpot_and_no_itl():
    one = RequestOutcome(3, sent_at=0.0, chunk_times=[0.25], num_output_tokens=1, done_at=0.25)
    assert one.tpot is None and one.itls == []
    summary = serve_summary([one], duration_s=1.0)
    assert summary["mean_ttft_ms"] == approx(250.0)
    assert summary["mean_tpot_ms"] == summary["mean_itl_ms"] == 0.0  # none to average, as vLLM


def test_an_unfinished_stream_is_failed():
    lost = RequestOutcome(3, sent_at=0.0, chunk_times=[0.1], num_output_tokens=2)  # no final
    summary = serve_summary([lost], duration_s=1.0)
    assert summary["failed"] == 1 and summary["errors"] == ["no final event"]


def test_the_table_names_every_figure():
    table = format_summary(serve_summary(_outcomes(), duration_s=2.0))
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):"):  # fmt: skip
        assert label in table
    assert table.split("\n")[1].split() == ["Successful", "requests:", "2"]
    assert table.split("\n")[-2].split() == ["P99", "E2EL", "(ms):", "699.00"]
