"""The small-row linear kernel (kernels/small_linear.py) on and off in one engine, alternated:
op_breakdown's long-tailed offline workload through `LLM.generate`, the linears and lm_head
timed where they are called (op_breakdown's timers), per dtype.

    python -m benchmarks.engine.small_linear_ab --dtype float32 bfloat16 [-n 64] [--rounds 3]
        [--switch KERNEL_ON|F32_TILES_ON]

One LLM per dtype; each round runs the workload with the kernel taking the rows it takes on
this host (engine/model/linear.py's `kernel_rows`), then with it off (oneDNN's packed matmul at
every row count: the same packed weights, so nothing else changes), and prints each arm's
fastest round (a loaded host only slows a round down) and every round's seconds. Off is
`linear.KERNEL_ON = False`, which every built linear reads at call time; `--switch
F32_TILES_ON` turns fp32's AMX tiles off instead (kernels/cpu/amx_linear_f32.c: their rows go
back to the small-row kernel and oneDNN).
"""

import argparse

from kvpager.engine.model import linear

from benchmarks.engine.op_breakdown import (
    LINEARS,
    Clock,
    instrumented_llm,
    run_each_dtype,
    timed_generate,
    workload_parser,
)

ARMS = {"on": True, "off": False}


def one_round(llm, clock: Clock, prompts, params) -> dict[str, float]:
    outputs, elapsed = timed_generate(llm, clock, prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    linears = sum(clock.seconds[f"linear {n}"] for n in LINEARS)
    return {
        "tok/s": tokens / elapsed,
        "s": elapsed,
        "linears s": linears,
        "lm_head s": clock.seconds["lm_head"],
    }


def run(args: argparse.Namespace, dtype: str) -> None:
    _, llm, clock, prompts, params = instrumented_llm(args, dtype, args.workload)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(args.rounds):
            for arm, on in ARMS.items():
                setattr(linear, args.switch, on)
                results[arm].append(one_round(llm, clock, prompts, params))
    finally:
        setattr(linear, args.switch, True)
        llm.close()
    print(
        f"\n{dtype}, {args.num_requests} requests, {args.switch} on and off, fastest of "
        f"{args.rounds} rounds alternated"
    )
    print("| arm | tok/s | s | linears s | lm_head s | every round's s |")
    print("|---|---|---|---|---|---|")
    for arm, rounds in results.items():
        fastest = min(rounds, key=lambda r: r["s"])
        every = ", ".join(f"{r['s']:.1f}" for r in rounds)
        print(f"| {arm} | " + " | ".join(f"{c:.2f}" for c in fastest.values()) + f" | {every} |")


def main() -> None:
    parser = workload_parser(__doc__.split("\n\n")[0], rounds=3)
    parser.add_argument("--switch", choices=("KERNEL_ON", "F32_TILES_ON"), default="KERNEL_ON")
    run_each_dtype(parser.parse_args(), run)


if __name__ == "__main__":
    main()
