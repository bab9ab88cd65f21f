"""What a benchmark measured, and the summaries its reports are built from.

`RequestOutcome` and `serve_summary` are `kvpager bench serve`'s figures, computed as
`vllm bench serve` computes them: TTFT from send to the first token, TPOT = (latency - TTFT) /
(output tokens - 1), ITL the gaps between streamed chunks, each as mean, median and p99 in ms.

`EngineResult` is the developer benchmarks' record of one engine run (benchmarks/peers). Its
times are seconds from the moment the whole workload was handed to the engine (an offline
batch: every request arrives at t = 0). TTFT therefore includes queueing behind earlier requests,
as it does in vLLM's offline throughput benchmark. Inter-token latency (ITL) is the gap between
consecutive tokens of one sequence; tokens that arrive in the same step have a gap of 0 only in
engines that batch output (none here).
"""

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class SequenceTimes:
    """Arrival times of one sequence's output tokens (one sample of a request)."""

    token_times: list[float] = field(default_factory=list)


@dataclass
class EngineResult:
    engine: str
    workload: str
    dtype: str
    elapsed_s: float = 0.0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens the workload asked for (useful work)
    # request index -> its sequences' token times; empty when the engine gives no timing
    sequences: dict[int, list[SequenceTimes]] = field(default_factory=dict)
    finish_times: list[float] = field(default_factory=list)
    latency_source: str = ""  # how token times were taken, for the report
    extra: dict = field(default_factory=dict)  # engine-specific: blocks, utilisation, waste
    skipped: str | None = None  # why the engine did not run

    def summary(self) -> dict:
        if self.skipped:
            return {"engine": self.engine, "workload": self.workload, "skipped": self.skipped}
        out = {
            "engine": self.engine,
            "workload": self.workload,
            "dtype": self.dtype,
            "elapsed_s": round(self.elapsed_s, 3),
            "num_requests": self.num_requests,
            "num_output_tokens": self.num_output_tokens,
            "output_tokens_per_s": round(self.num_output_tokens / self.elapsed_s, 2),
            "total_tokens_per_s": round(
                (self.num_output_tokens + self.num_prompt_tokens) / self.elapsed_s, 2
            ),
            "requests_per_s": round(self.num_requests / self.elapsed_s, 4),
            "latency_source": self.latency_source,
        }
        out.update(self._latencies())
        out.update(self.extra)
        return out

    def _latencies(self) -> dict:
        ttft, itl = [], []
        for seqs in self.sequences.values():
            first = [s.token_times[0] for s in seqs if s.token_times]
            if first:
                ttft.append(min(first))  # the request's first token, whichever sample
            for seq in seqs:
                itl.extend(np.diff(seq.token_times).tolist())
        out = {}
        out.update(percentiles("ttft_ms", ttft))
        out.update(percentiles("itl_ms", itl))
        out.update(percentiles("e2e_ms", self.finish_times))
        return out


def percentiles(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {}
    values = np.percentile(np.asarray(seconds) * 1000.0, PERCENTILES)
    return {f"{name}_p{p}": round(float(v), 2) for p, v in zip(PERCENTILES, values)}


def skipped(engine: str, workload: str, dtype: str, why: str) -> EngineResult:
    return EngineResult(engine, workload, dtype, skipped=why)


@dataclass
class RequestOutcome:
    """One request as its client saw it; times are `time.perf_counter()` seconds."""

    num_prompt_tokens: int
    sent_at: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    num_output_tokens: int = 0
    done_at: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_at is not None and self.num_output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent_at

    @property
    def latency(self) -> float:
        assert self.done_at is not None, "a finished request has a final time"
        return self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single token."""
        if self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def serve_summary(outcomes: list[RequestOutcome], duration_s: float) -> dict:
    """Counts, throughput and the TTFT / TPOT / ITL / E2E statistics (ms) of finished requests;
    failed requests count as failed and add no tokens or latencies."""
    done = [o for o in outcomes if o.ok]
    num_input = sum(o.num_prompt_tokens for o in done)
    num_output = sum(o.num_output_tokens for o in done)
    out = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": num_output / duration_s,
        "total_token_throughput": (num_input + num_output) / duration_s,
        "errors": sorted({o.error or "no final event" for o in outcomes if not o.ok})[:5],
    }
    out.update(_stats("ttft", [o.ttft for o in done]))
    out.update(_stats("tpot", [t for o in done if (t := o.tpot) is not None]))
    out.update(_stats("itl", [gap for o in done for gap in o.itls]))
    out.update(_stats("e2el", [o.latency for o in done]))
    return out


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    """mean, median and p99 in ms (0 with no values, as vLLM prints them)."""
    values = np.asarray(seconds or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(values)), f"median_{name}_ms": float(np.median(values))}
    out[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    return out


LABELS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
LABELS |= {"itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
STAT_NAMES = {"mean": "Mean", "median": "Median", "p99": "P99"}


def format_summary(summary: dict, title: str = "Serving Benchmark Result") -> str:
    """The table `vllm bench serve` prints, from a `serve_summary`."""
    rows = [
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"),
    ]
    lines = [f" {title} ".center(60, "=")] + [f"{label:<45}{value}" for label, value in rows]
    for name, label in LABELS.items():
        lines.append(f" {label} ".center(60, "-"))
        for stat, stat_name in STAT_NAMES.items():
            row = f"{stat_name} {name.upper()} (ms):"
            lines.append(f"{row:<45}{summary[f'{stat}_{name}_ms']:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
