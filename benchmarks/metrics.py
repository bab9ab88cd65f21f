"""What one engine run measured, and the summary every report is built from.

All times are seconds from the moment the whole workload was handed to the engine (an offline
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
