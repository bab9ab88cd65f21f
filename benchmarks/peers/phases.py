"""An offline run's steps split into phases, the same way for kvpager and vLLM: the prefill
phase (until every request has its first token), the full-batch decode, and the tail (fewer
than `tail_rows` sequences left). Pure Python on step records, so both virtualenvs import it
(benchmarks/engine/phase_split.py for kvpager, benchmarks/peers/vllm_phases.py for vLLM).
"""

import itertools
import statistics
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """One executed step: when it ended (seconds from the run's start) and its rows, each
    seq id -> (tokens computed this step, computed after it, prompt length)."""

    end_s: float
    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _, _ in self.rows.values())

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of rows still inside their prompt (a chunk, or its last one)."""
        return sum(n for n, after, prompt in self.rows.values() if after - n < prompt)


def first_token_times(steps: list[StepRecord]) -> dict[str, float]:
    """Seq id -> end of the step whose chunk completed its prompt (its first token)."""
    firsts: dict[str, float] = {}
    for step in steps:
        for seq_id, (n, after, prompt) in step.rows.items():
            if seq_id not in firsts and after >= prompt and after - n < prompt:
                firsts[seq_id] = step.end_s
    return firsts


def _phase(steps: list[StepRecord], start_s: float) -> dict:
    if not steps:
        return {"wall_s": 0.0, "steps": 0, "rows_mean": 0.0, "tokens_mean": 0.0}
    return {
        "wall_s": round(steps[-1].end_s - start_s, 3),
        "steps": len(steps),
        "rows_mean": round(statistics.fmean(len(s.rows) for s in steps), 1),
        "tokens_mean": round(statistics.fmean(s.num_tokens for s in steps), 1),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "ms_per_step": round(1000 * (steps[-1].end_s - start_s) / len(steps), 1),
    }


def split(steps: list[StepRecord], tail_rows: int = 16) -> dict:
    """Phases by wall time, steps and rows a step, with first-token percentiles."""
    steps = [s for s in steps if s.rows]
    firsts = first_token_times(steps)
    prefill_end = max(firsts.values(), default=0.0)
    prefill = [s for s in steps if s.end_s <= prefill_end]
    rest = steps[len(prefill) :]
    decode = list(itertools.takewhile(lambda s: len(s.rows) >= tail_rows, rest))
    tail = rest[len(decode) :]
    ttft = sorted(firsts.values())
    return {
        "by_rows": by_rows(rest),
        "total_s": round(steps[-1].end_s, 3) if steps else 0.0,
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1) if ttft else 0.0,
        "prefill": _phase(prefill, 0.0),
        "full decode": _phase(decode, prefill_end),
        "tail": _phase(tail, decode[-1].end_s if decode else prefill_end),
        "first_steps": [(round(s.end_s, 3), len(s.rows), s.num_tokens) for s in steps[:8]],
    }


ROW_BUCKETS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 1 << 30))


def by_rows(steps: list[StepRecord]) -> list[tuple[str, int, float, float]]:
    """Decode steps after the prefill phase by their rows: (rows, steps, ms a step, mean
    context a row), a step's time from the previous step's end."""
    buckets: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for before, step in zip(steps, steps[1:]):
        rows = len(step.rows)
        key = next(b for b in ROW_BUCKETS if b[0] <= rows <= b[1])
        context = statistics.fmean(after for _, after, _ in step.rows.values())
        buckets.setdefault(key, []).append((step.end_s - before.end_s, context))
    rows = []
    for (lo, hi), v in sorted(buckets.items()):
        name = f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
        ms = round(1000 * statistics.fmean(t for t, _ in v), 1)
        rows.append((name, len(v), ms, round(statistics.fmean(c for _, c in v))))
    return rows


def markdown(name: str, result: dict) -> str:
    """One engine's phases as a table."""
    lines = [
        f"{name}: {result['total_s']:.2f} s, TTFT p50 {result['ttft_p50_ms']:.0f} ms",
        "| phase | wall s | steps | ms/step | rows/step | tokens/step | prefill tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in ("prefill", "full decode", "tail"):
        p = result[phase]
        lines.append(
            f"| {phase} | {p['wall_s']:.2f} | {p['steps']} | {p.get('ms_per_step', 0)} | "
            f"{p['rows_mean']} | {p['tokens_mean']} | {p.get('prefill_tokens', 0)} |"
        )
    lines.append(f"first steps (end s, rows, tokens): {result['first_steps']}")
    lines += ["| rows | steps | ms/step | context |", "|---|---|---|---|"]
    lines += [f"| {rows} | {n} | {ms} | {ctx} |" for rows, n, ms, ctx in result.get("by_rows", ())]
    return "\n".join(lines)
