"""A decode step of `rows` sequences sampling at temperature 1 (the served benchmark's client
sends no temperature, and both servers then sample at 1), its median over 59 steps, twice:
run at two commits for the sampler's A/B.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/sampled_step.py \
        bfloat16 64 300
"""

import time

from decode_setup import decoding_setup
from kvpager.engine import SamplingParams


def main() -> None:
    dtype, rows, llm, prompts = decoding_setup()
    executor, execute = llm.executor, llm.executor._execute
    times = []

    def timed(step):
        start = time.perf_counter()
        out = execute(step)
        times.append((step.total_num_scheduled_tokens, time.perf_counter() - start))
        return out

    executor._execute = timed
    for _ in range(2):
        times.clear()
        params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0)
        llm.generate(prompts, params, use_tqdm=False)
        decode = sorted(t for n, t in times if n == rows)
        median = decode[len(decode) // 2] * 1e3
        print(f"{dtype}, {rows} rows sampled: decode step median {median:.1f} ms", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
