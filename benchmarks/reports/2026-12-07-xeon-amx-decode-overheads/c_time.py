"""Where a decode step's time goes outside the C kernels: SmolLM2-135M, `rows` sequences of
`context` prompt tokens decoding together; every ctypes call into kernels/cpu/*.so during one
decode step is timed on its own, and set beside the executor's whole step (its median over the
run's decode steps). The rest is Python and torch: glue, allocations, the lm_head where oneDNN
runs it, sampling.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/c_time.py \
        float32 3 540
"""

import time

from decode_setup import decoding_setup, wrap_kernels
from kvpager.engine import SamplingParams


def main() -> None:
    dtype, rows, llm, prompts = decoding_setup()
    record: list | None = None

    def timed_call(fn):
        def call(*args):
            if record is None:
                return fn(*args)
            start = time.perf_counter()
            status = fn(*args)
            record.append((fn.__name__, time.perf_counter() - start))
            return status

        return call

    wrap_kernels(timed_call)
    executor, execute = llm.executor, llm.executor._execute
    steps, calls = [], []

    def step_timed(step):
        nonlocal record
        decode = step.total_num_scheduled_tokens == rows
        record = [] if decode and not calls else None
        start = time.perf_counter()
        out = execute(step)
        steps.append((decode, time.perf_counter() - start))
        if record:
            calls.append((steps[-1][1], record))
        record = None
        return out

    executor._execute = step_timed
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)
    decode = sorted(t for d, t in steps if d)[5:]
    step_s, recorded = calls[0]
    totals: dict[str, float] = {}
    for name, seconds in recorded:
        totals[name] = totals.get(name, 0.0) + seconds
    print(f"{dtype}, {rows} rows x {len(prompts[0])} tokens: decode step median "
          f"{decode[len(decode) // 2] * 1e3:.1f} ms; the recorded step {step_s * 1e3:.1f} ms, "
          f"{len(recorded)} C calls, {sum(totals.values()) * 1e3:.1f} ms in them")  # fmt: skip
    for name, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {name}: {seconds * 1e3:.2f} ms")
    llm.close()


if __name__ == "__main__":
    main()
