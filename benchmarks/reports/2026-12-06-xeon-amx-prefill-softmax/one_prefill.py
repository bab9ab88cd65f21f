"""Prefills of 1,000-token prompts alone, one token each, through the offline engine with
op_breakdown's timers: ms of the whole `generate` and of its largest ops (attention among them).

    PYTHONPATH=. python benchmarks/reports/2026-12-06-xeon-amx-prefill-softmax/one_prefill.py
"""

import msgspec

from benchmarks.engine import op_breakdown as ob


def main() -> None:
    args = ob.workload_parser("prefills", 1).parse_args(
        ["--dtype", "bfloat16", "--workload", "first-token"]
    )
    _, llm, clock, prompts, params = ob.instrumented_llm(args, "bfloat16", args.workload)
    params = [msgspec.structs.replace(p, max_tokens=1) for p in params]
    for count in (1, 1, 1, 2, 2):  # the first call of each size warms it
        clock.seconds.clear()
        clock.calls.clear()
        _, elapsed = ob.timed_generate(llm, clock, prompts[:count], params[:count])
        ops = {name: round(s * 1e3) for name, s in clock.seconds.most_common(8)}
        print(f"{count} prompt(s): {elapsed * 1e3:.0f} ms; ms by op: {ops}", flush=True)
        prompts, params = prompts[count:], params[count:]


if __name__ == "__main__":
    main()
