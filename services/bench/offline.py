"""`kvpager bench throughput` and `kvpager bench latency`: the offline engine (`engine.LLM`, no
NATS) on random token-id prompts, as `vllm bench throughput` / `vllm bench latency` measure it.

Both warm the engine up first and reset its prefix cache before every timed run, so each run
computes its prompts in full.
"""

import time

import numpy as np
from kvpager.engine import LLM, SamplingParams
from kvpager.services.bench.workloads import TokenSource, uniform

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def warm_up(llm: LLM) -> None:
    """A few short requests so one-time costs (allocator, first kernels) stay off the clock."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[100 + i] * (8 + 8 * i) for i in range(4)], params, use_tqdm=False)
    llm.scheduler.block_manager.reset_prefix_cache()


def random_prompts(llm: LLM, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Prompts of `input_len` random ids of the model's vocabulary, special ids left out."""
    source = TokenSource(llm.model_config.vocab_size, frozenset(llm.tokenizer.all_special_ids))
    workload = uniform(source, num_prompts, (input_len, input_len), (1, 1), seed)
    return [request.prompt_token_ids for request in workload.requests]


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def _timed_generate(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """Seconds to generate every prompt to `output_len` tokens, and the tokens made."""
    llm.scheduler.block_manager.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, _params(output_len), use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def throughput(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt handed to the engine at once: requests/s and tokens/s over the run."""
    warm_up(llm)
    elapsed, num_output = _timed_generate(llm, prompts, output_len)
    num_input = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(prompts),
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
    }


def latency(
    llm: LLM, prompts: list[list[int]], output_len: int, num_iters: int, num_iters_warmup: int = 1
) -> dict:
    """One batch end to end, `num_iters` times after `num_iters_warmup` untimed runs."""
    warm_up(llm)
    for _ in range(num_iters_warmup):
        _timed_generate(llm, prompts, output_len)
    seconds = [_timed_generate(llm, prompts, output_len)[0] for _ in range(num_iters)]
    out = {"latencies_s": seconds, "avg_latency_s": float(np.mean(seconds))}
    values = np.percentile(seconds, LATENCY_PERCENTILES)
    out.update({f"p{p}_latency_s": float(v) for p, v in zip(LATENCY_PERCENTILES, values)})
    return out
