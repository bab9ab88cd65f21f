"""The small-row linear kernel (kernels/small_linear.py) on and off in one engine, alternated:
op_breakdown's long-tailed offline workload through `LLM.generate`, the linears and lm_head
timed where they are called (op_breakdown's timers), per dtype.

    python -m benchmarks.engine.small_linear_ab --dtype bfloat16 float32 [-n 64] [--rounds 3]

One LLM per dtype; each round runs the workload with the kernel taking rows up to
KERNEL_ROWS, then with it off (oneDNN's packed matmul at every row count: the same packed
weights, so nothing else changes), and prints each arm's median over rounds. Off is
`linear.KERNEL_ROWS = 0`, which every built linear reads at call time.
"""

import argparse
import statistics
import time

import torch
from kvpager.engine.download import resolve_model
from kvpager.engine.model import linear
from kvpager.kernels.isa import isa_flags
from kvpager.services.bench.offline import warm_up

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm
from benchmarks.engine.op_breakdown import LINEARS, Clock, instrument, workload_requests

ARMS = {"kernel": linear.KERNEL_ROWS, "oneDNN": 0}


def one_round(llm, clock: Clock, prompts, params) -> dict[str, float]:
    clock.seconds.clear()
    clock.calls.clear()
    llm.scheduler.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    linears = sum(clock.seconds[f"linear {n}"] for n in LINEARS)
    return {
        "tok/s": tokens / elapsed,
        "s": elapsed,
        "linears s": linears,
        "lm_head s": clock.seconds["lm_head"],
    }


def run(args: argparse.Namespace, dtype: str) -> None:
    model_path = resolve_model(args.model)
    cfg = BenchConfig(model_path, dtype=dtype, num_threads=args.threads)
    prompts, params = workload_requests(model_path, args.num_requests, "sharegpt-like")
    llm = build_llm(cfg)
    clock = Clock()
    instrument(llm, clock)
    warm_up(llm)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(args.rounds):
            for arm, rows in ARMS.items():
                linear.KERNEL_ROWS = rows
                results[arm].append(one_round(llm, clock, prompts, params))
    finally:
        linear.KERNEL_ROWS = ARMS["kernel"]
        llm.close()
    print(f"\n{dtype}, {args.num_requests} requests, median of {args.rounds} rounds alternated")
    print("| arm | tok/s | s | linears s | lm_head s |\n|---|---|---|---|---|")
    for arm, rounds in results.items():
        cells = [statistics.median(r[key] for r in rounds) for key in rounds[0]]
        print(f"| {arm} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("-n", "--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ISA flags: {' '.join(isa_flags()) or 'none'}")
    for dtype in args.dtype:
        run(args, dtype)


if __name__ == "__main__":
    main()
