"""`kvpager bench serve` against a real `kvpager serve` (HTTP and NATS), and `kvpager bench
throughput` / `latency` on the tiny model, each run as the installed command runs."""

import json

from tests.models import VOCAB_SIZE
from tests.services.http_fixture import served  # noqa: F401
from tests.services.kvpager_cli import kvpager

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 12, 16, 8


def _figures(result, path) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(path.read_text())


def _check_serve(figures: dict) -> None:
    assert figures["completed"] == NUM_PROMPTS and figures["failed"] == 0, figures
    assert figures["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert figures["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # EOS ignored
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (figures[f"{s}_{name}_ms"] for s in ("mean", "median", "p99"))
        assert 0 < median <= p99 and 0 < mean <= figures["duration_s"] * 1000, (name, figures)
    # a request's first token comes before its last, and its tokens within its latency
    assert figures["p99_ttft_ms"] <= figures["p99_e2el_ms"]
    assert figures["mean_tpot_ms"] * (OUTPUT_LEN - 1) <= figures["mean_e2el_ms"]
    expected = figures["total_output_tokens"] / figures["duration_s"]
    assert abs(figures["output_throughput"] - expected) < 1e-6 * expected


def test_bench_serve_over_http(served, tmp_path):  # noqa: F811
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--base-url", served.base_url, "--vocab-size", str(VOCAB_SIZE)]
    args += ["--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN)]
    args += ["--output-len", str(OUTPUT_LEN), "--request-rate", "50", "--max-concurrency", "4"]
    result = kvpager(*args, "--json", str(out), timeout=300)
    _check_serve(_figures(result, out))
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                  "Request throughput (req/s):", "Output token throughput (tok/s):"):  # fmt: skip
        assert label in result.stdout


def test_bench_serve_over_nats(served, tmp_path):  # noqa: F811
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--backend", "nats", "--nats-url", served.nats_url]
    args += ["--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN)]
    args += ["--output-len", str(OUTPUT_LEN)]  # all at once, the vocabulary from the model card
    _check_serve(_figures(kvpager(*args, "--json", str(out), timeout=300), out))


def test_bench_serve_given_prompts(served, tiny_llama, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    prompts = ["the cat sat on the mat", "a paged cache"]
    lengths = [len(AutoTokenizer.from_pretrained(str(tiny_llama)).encode(p)) for p in prompts]
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--base-url", served.base_url, "--tokenizer", str(tiny_llama)]
    args += ["--prompt", prompts[0], "--prompt", prompts[1], "--num-prompts", "5"]
    args += ["--output-len", "3", "--max-concurrency", "2"]
    figures = _figures(kvpager(*args, "--json", str(out), timeout=300), out)
    assert (figures["completed"], figures["total_output_tokens"]) == (5, 15)
    assert figures["total_input_tokens"] == 3 * lengths[0] + 2 * lengths[1]  # round-robin


def test_bench_serve_given_prompts_need_a_tokenizer(served):  # noqa: F811
    result = kvpager("bench", "serve", "--base-url", served.base_url, "--prompt", "hello")
    assert result.returncode == 2 and "--tokenizer" in result.stderr


def test_bench_throughput(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--model", str(tiny_llama), "--num-prompts", "6"]
    args += ["--input-len", "12", "--output-len", "5", "--num-blocks", "64"]
    result = kvpager(*args, "--json", str(out), timeout=300)
    figures = _figures(result, out)
    assert figures["num_requests"] == 6 and figures["total_output_tokens"] == 30
    assert figures["total_input_tokens"] == 72
    assert abs(figures["output_tokens_per_s"] * figures["elapsed_s"] - 30) < 1e-6
    assert "output tokens/s" in result.stdout


def test_bench_latency(tiny_llama, tmp_path):
    out = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", str(tiny_llama), "--batch-size", "3"]
    args += ["--input-len", "8", "--output-len", "4", "--num-iters", "4", "--num-blocks", "64"]
    result = kvpager(*args, "--json", str(out), timeout=300)
    figures = _figures(result, out)
    latencies = figures["latencies_s"]
    assert len(latencies) == 4 and all(s > 0 for s in latencies)
    assert min(latencies) <= figures["p50_latency_s"] <= figures["p99_latency_s"] <= max(latencies)
    assert abs(figures["avg_latency_s"] - sum(latencies) / 4) < 1e-9
    assert "Avg latency:" in result.stdout and "99% percentile latency" in result.stdout
