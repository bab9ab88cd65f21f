"""The long tail by hand: 24 requests of 20-200 random prompt tokens and 8-160 greedy output
tokens (ignore_eos), SmolLM2-135M-Instruct, three rounds in one LLM (the first captures the
decode graphs); tok/s a round and the decode graphs kept (off, max_rows, batch sizes).

    python benchmarks/reports/2026-12-07-zen4-small-batch-graphs/small_batches.py bfloat16 [eager]
"""

import random
import sys
import time

from kvpager.engine import LLM, SamplingParams
from kvpager.engine.download import resolve_model

dtype, eager = sys.argv[1], len(sys.argv) > 2
llm = LLM(str(resolve_model("smollm2-135m-instruct")), dtype=dtype, attention_backend="cpu",
          enforce_eager=eager)  # fmt: skip
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 200))] for _ in range(24)]
params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 160), ignore_eos=True)
          for _ in prompts]  # fmt: skip
llm.generate(prompts[:2], params[:2], use_tqdm=False)
for _ in range(3):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    graphs = llm.executor.graphs
    kept = None if graphs is None else (graphs.off, graphs.max_rows, sorted(graphs.graphs))
    print(f"{tokens} tokens {seconds:.2f}s {tokens / seconds:.1f} tok/s; graphs {kept}")
