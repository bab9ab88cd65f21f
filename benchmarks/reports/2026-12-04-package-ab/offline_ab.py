"""A/B: offline throughput of the same engine before and after the package change (#44)."""

import sys
import time

try:
    from kvpager import LLM, SamplingParams
except ImportError:
    from engine import LLM, SamplingParams  # noqa: TID251 (the tree before the change)

import random

rng = random.Random(0)
prompts = [[rng.randrange(3, 49000) for _ in range(128)] for _ in range(64)]
llm = LLM("smollm2-135m-instruct", dtype=sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
took = time.perf_counter() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"{tokens / took:.1f} tok/s ({tokens} tokens in {took:.2f} s)")
