"""Speculative decoding (n-gram prompt lookup, suffix decoding) against plain decoding, on
SmolLM2-135M.

    python -m benchmarks.engine.spec_decode [--methods ngram suffix] [--k 4] [--suffix-k 24]
        [--methods draft_model --draft-model PATH]
        [--rewrites 6] [--agent-files 3] [--random 64] [--max-tokens 256]
    python -m benchmarks.engine.spec_decode --smoke   # minutes: tiny sizes, numbers meaningless
    python -m benchmarks.engine.spec_decode --proposer-cost   # the suffix lookup alone, no model

Three workloads, each run without and with `speculative_config` (one LLM per arm), greedy:
- code rewrites, one request at a time: a function of the stdlib `json` package (text no one
  here wrote, read from its installed source) and the instruction to add type hints and keep
  the rest; the answer copies most of its prompt, which prompt lookup finds;
- an agent loop, one request at a time, three turns a file: the rewrite; a follow-up in the
  same conversation (its answer in the history: add docstrings, answer with the whole
  function); then the rewrite asked again in a fresh conversation, as an agent retrying a
  step does; suffix decoding finds the third turn's answer in the first one's output, which
  its own tokens never hold;
- `--random` prompts of random token ids at once, where nothing can be looked up (and the
  batch is past `max_num_seqs_to_speculate` unless it is raised).
Prints tokens/s of each arm, their ratio, the acceptance rate, the mean accepted length and
the proposer's own time per call (ms: the lookup, measured around it in the executor), and
checks that every arm produced the plain arm's tokens.
"""

import argparse
import inspect
import json
import json.decoder
import json.encoder
import random
import time
from functools import partial

import numpy as np
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.worker.spec_decode.suffix_proposer import SuffixProposer

FUNCTIONS = [
    json.encoder.py_encode_basestring_ascii,
    json.encoder.JSONEncoder.default,
    json.encoder.JSONEncoder.encode,
    json.encoder.JSONEncoder.iterencode,
    json.decoder.JSONObject,
    json.decoder.py_scanstring,
    json.dumps,
    json.loads,
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=4, help="ngram's and draft_model's k")
    parser.add_argument("--draft-model", help="the draft's path, for --methods draft_model")
    parser.add_argument("--suffix-k", type=int, default=24, help="suffix's (vLLM: the depth)")
    parser.add_argument("--rewrites", type=int, default=6)
    parser.add_argument("--agent-files", type=int, default=3)
    parser.add_argument("--random", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-to-speculate", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--proposer-cost", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rewrites, args.agent_files, args.random, args.max_tokens = 1, 1, 8, 32
    return args


FOLLOW_UP = "Now also add a one-line docstring. Answer with the whole function, code only."


def rewrite_ask(function) -> str:
    source = inspect.getsource(function)
    return (
        "Rewrite this Python function with type hints added. Keep every line, name and "
        f"comment otherwise identical. Answer with the code only.\n\n```python\n{source}```"
    )


def rewrite_prompts(llm: LLM, count: int) -> list[list[int]]:
    asks = [rewrite_ask(function) for function in FUNCTIONS[:count]]
    return [llm.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]


def run_agent_loop(llm: LLM, count: int, params: SamplingParams) -> dict:
    """Three turns a file, one request at a time; each turn's prompt depends on the answers
    (so each arm builds its own, from its own answers: the same when greedy tokens are)."""
    start, tokens = time.perf_counter(), []

    def ask(messages: list[dict]) -> str:
        prompt = llm.apply_chat_template(messages)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        tokens.append(out.token_ids)
        return out.text

    for function in FUNCTIONS[:count]:
        first = [{"role": "user", "content": rewrite_ask(function)}]
        answer = ask(first)
        ask(
            [
                *first,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP},
            ]
        )
        ask(first)  # a fresh conversation: the same step retried
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / elapsed, "s": elapsed}


def random_prompts(count: int, vocab_size: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def run(llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> dict:
    start, tokens = time.perf_counter(), []
    for batch in batches:
        tokens += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / elapsed, "s": elapsed}


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


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.proposer_cost:
        proposer_cost()
        return
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(args.model, dtype="float32", seed=0)
    rewrites = [[p] for p in rewrite_prompts(plain, args.rewrites)]
    randoms = [random_prompts(args.random, plain.model_config.vocab_size)]
    workloads = {
        "rewrite, one at a time": partial(run, batches=rewrites, params=params),
        "agent loop, one at a time": partial(run_agent_loop, count=args.agent_files, params=params),
        f"{args.random} random prompts at once": partial(run, batches=randoms, params=params),
    }
    for name, workload in workloads.items():
        # a fresh engine per workload and arm: no prefix cache or suffix cache carried over
        base = workload(LLM(args.model, dtype="float32", seed=0))
        for method in args.methods:
            config = spec_config(method, args)
            llm = LLM(args.model, dtype="float32", seed=0, speculative_config=config)
            timer = ProposerTimer(llm)
            spec_run = workload(llm)
            report = {
                "workload": name,
                "method": method,
                "plain_tok_s": round(base["tok_s"], 1),
                "spec_tok_s": round(spec_run["tok_s"], 1),
                "ratio": round(spec_run["tok_s"] / base["tok_s"], 3),
                "same_tokens": base["tokens"] == spec_run["tokens"],
                **acceptance(llm.stats()),
                "proposer_ms_per_step": timer.ms_per_step(),
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
