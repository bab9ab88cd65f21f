"""One 1,000-token prompt's prefill (max_tokens 1) through the offline engine, bf16, at a
`long_prefill_token_threshold` (argv[1]; 0: one step): ms of the whole generate and each
forward's wall and thread CPU ms, for rounds 5-8 of 8.

    python benchmarks/reports/2026-12-06-xeon-amx-first-token/one_prompt.py 512
"""

import random
import sys
import time

import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.download import resolve_model

if __name__ == "__main__":
    torch.set_num_threads(2)
    threshold = int(sys.argv[1])
    llm = LLM(
        str(resolve_model("smollm2-135m-instruct")), dtype="bfloat16", max_model_len=2048,
        long_prefill_token_threshold=threshold, enable_prefix_caching=False,
    )  # fmt: skip
    forward, log = llm.executor.model.forward, []

    def timed_forward(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = forward(*args, **kwargs)
        log.append(
            (round((time.perf_counter() - wall) * 1e3), round((time.thread_time() - cpu) * 1e3))
        )
        return out

    llm.executor.model.forward = timed_forward
    rng, params = random.Random(0), SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(8):
        log.clear()
        prompt = [rng.randrange(100, 40000) for _ in range(1000)]
        start = time.perf_counter()
        llm.generate([prompt], [params], use_tqdm=False)
        if i >= 4:
            took = (time.perf_counter() - start) * 1e3
            print(f"threshold {threshold}: {took:.0f} ms; forwards {log}")
