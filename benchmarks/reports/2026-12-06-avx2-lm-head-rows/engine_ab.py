"""Engine-level A/B of the fp32 lm_head's kernel cap (engine/model/linear_choice.py's
KERNEL_OUT_ELEMENTS): two LLMs in one process, the cap as it is and lifted, op_breakdown's
workload, rounds alternated, the lm_head timed where it is called.

    PYTHONPATH=. python benchmarks/reports/2026-12-06-avx2-lm-head-rows/engine_ab.py --rounds 2
"""

import torch
from kvpager.engine.model import linear

from benchmarks.engine.op_breakdown import instrumented_llm, timed_generate, workload_parser

ARMS = {"capped": linear.KERNEL_OUT_ELEMENTS, "lifted": 1 << 30}


def main() -> None:
    args = workload_parser(__doc__.split("\n\n")[0], rounds=3).parse_args()
    torch.set_num_threads(args.threads)
    built = {}
    for name, cap in ARMS.items():
        linear.KERNEL_OUT_ELEMENTS = cap  # read by kernel_rows while the LLM builds
        _, llm, clock, prompts, params = instrumented_llm(args, "float32", args.workload)
        built[name] = (llm, clock)
    linear.KERNEL_OUT_ELEMENTS = ARMS["capped"]
    results, outputs = {name: [] for name in built}, {}
    for r in range(args.rounds):
        for name, (llm, clock) in built.items():
            out, seconds = timed_generate(llm, clock, prompts, params)
            outputs[name] = [o.outputs[0].token_ids for o in out]
            lm_head, calls = clock.seconds["lm_head"], clock.calls["lm_head"]
            results[name].append((seconds, lm_head))
            print(f"{name} {r} run {seconds:.1f}s lm_head {lm_head:.2f}s calls {calls}", flush=True)
    same = sum(a == b for a, b in zip(outputs["capped"], outputs["lifted"]))
    print("identical outputs", same, "of", len(outputs["capped"]))
    for name, rounds in results.items():
        best_run, best_lm_head = min(r[0] for r in rounds), min(r[1] for r in rounds)
        print(name, "best run", best_run, "best lm_head", best_lm_head)


if __name__ == "__main__":
    main()
