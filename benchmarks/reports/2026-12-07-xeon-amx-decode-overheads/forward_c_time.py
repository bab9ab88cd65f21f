"""Decoder.forward alone (no lm_head, no sampling) over 40 greedy decode steps: its wall time
against the time inside its ctypes calls into the C kernels, the mean of the middle steps.
What is outside is the layers' Python and torch glue (views, allocations, the embedding and
the rotary rows), cold after each linear streams its weight.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/forward_c_time.py \
        bfloat16 64 300
"""

import time

from decode_setup import decoding_setup, wrap_kernels
from kvpager.engine import SamplingParams


def main() -> None:
    dtype, rows, llm, prompts = decoding_setup()
    in_c, counting = [0.0], [False]

    def timed_call(fn):
        def call(*args):
            if not counting[0]:
                return fn(*args)
            start = time.perf_counter()
            status = fn(*args)
            in_c[0] += time.perf_counter() - start
            return status

        return call

    wrap_kernels(timed_call)
    model, forward, steps = llm.executor.model, llm.executor.model.forward, []

    def timed_forward(input_ids, *args, **kwargs):
        decode = input_ids.shape[0] == rows
        in_c[0], counting[0] = 0.0, decode
        start = time.perf_counter()
        out = forward(input_ids, *args, **kwargs)
        counting[0] = False
        if decode:
            steps.append((time.perf_counter() - start, in_c[0]))
        return out

    model.forward = timed_forward
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)
    middle = sorted(steps)[5:-5]
    wall = sum(s for s, _ in middle) / len(middle) * 1e3
    c = sum(c for _, c in middle) / len(middle) * 1e3
    print(f"{dtype}, {rows} rows x {len(prompts[0])} tokens: Decoder.forward {wall:.1f} ms, "
          f"in C calls {c:.1f} ms, outside {wall - c:.1f} ms")  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
