"""Decode steps with and without decode graphs (engine/worker/decode_graphs.py), alternated:
SmolLM2-135M as the benchmarks build it, `rows` prompts of `context` tokens (a few apart, so
the prefix cache shares nothing), 64 tokens each, greedy; the median and mean time of the
executor's decode steps of all `rows` sequences (schedule to sampled tokens), the graphs'
capture times, and whether both runs made the same tokens.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-graphs/graph_steps.py \\
        bfloat16 64 300
"""

import hashlib
import sys
import time

import torch
from kvpager.engine import SamplingParams
from kvpager.engine.download import resolve_model
from kvpager.kernels import cpu_graph

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm

ROUNDS = 2


def decode_steps(dtype: str, rows: int, context: int, eager: bool) -> tuple:
    llm = build_llm(BenchConfig(resolve_model("smollm2-135m-instruct"), dtype=dtype),
                    enforce_eager=eager)  # fmt: skip
    prompts = [[(i * 37 + j * 11) % 40000 + 100 for j in range(context + i * 7)]
               for i in range(rows)]  # fmt: skip
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    executor, steps, captures = llm.executor, [], []
    forward, capture = executor._forward, cpu_graph.capture

    def timed_forward(step):
        start = time.perf_counter()
        out = forward(step)
        if len(step.num_scheduled_tokens) == sum(step.num_scheduled_tokens.values()) == rows:
            steps.append(time.perf_counter() - start)
        return out

    def timed_capture(*args, **kwargs):
        start = time.perf_counter()
        graph = capture(*args, **kwargs)
        captures.append(time.perf_counter() - start)
        return graph

    executor._forward, cpu_graph.capture = timed_forward, timed_capture
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cpu_graph.capture = capture
    llm.close()
    tokens = hashlib.sha1(str([o.outputs[0].token_ids for o in outputs]).encode()).hexdigest()
    return sorted(steps), captures, tokens


def main() -> None:
    dtype, rows, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    for round_ in range(ROUNDS):
        for eager in (True, False):
            steps, captures, tokens = decode_steps(dtype, rows, context, eager)
            median, mean = steps[len(steps) // 2] * 1e3, sum(steps) / len(steps) * 1e3
            kind = "eager " if eager else "graphs"
            captured = ", ".join(f"{c * 1e3:.0f}" for c in captures) or "-"
            print(f"{dtype} {rows} rows, round {round_ + 1}, {kind}: decode step median "
                  f"{median:.1f} ms, mean {mean:.1f} (n={len(steps)}); captures (ms) "
                  f"{captured}; tokens {tokens[:12]}")  # fmt: skip


if __name__ == "__main__":
    main()
