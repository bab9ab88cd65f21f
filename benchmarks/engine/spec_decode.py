"""Speculative decoding (n-gram prompt lookup) against plain decoding, on SmolLM2-135M.

    python -m benchmarks.engine.spec_decode [--k 4] [--rewrites 6] [--random 64] [--max-tokens 256]
    python -m benchmarks.engine.spec_decode --smoke        # a minute: 1 rewrite, 8 random prompts

Two workloads, each run with and without `speculative_config`, greedy, one LLM per arm:
- code rewrites, one request at a time: a function of the stdlib `json` package (text no one
  here wrote, read from its installed source) and the instruction to add type hints and keep
  the rest; the answer copies most of its prompt, which prompt lookup finds;
- `--random` prompts of random token ids at once, where nothing can be looked up (and the
  batch is past `max_num_seqs_to_speculate` unless it is raised).
Prints tokens/s of each arm, their ratio, the acceptance rate and the mean accepted length,
and checks that both arms produced the same tokens.
"""

import argparse
import inspect
import json
import json.decoder
import json.encoder
import random
import time

from kvpager.engine import LLM, SamplingParams

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
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rewrites", type=int, default=6)
    parser.add_argument("--random", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-to-speculate", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rewrites, args.random, args.max_tokens = 1, 8, 64
    return args


def rewrite_prompts(llm: LLM, count: int) -> list[list[int]]:
    prompts = []
    for function in FUNCTIONS[:count]:
        source = inspect.getsource(function)
        ask = (
            "Rewrite this Python function with type hints added. Keep every line, name and "
            f"comment otherwise identical. Answer with the code only.\n\n```python\n{source}```"
        )
        prompts.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
    return prompts


def random_prompts(count: int, vocab_size: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def run(llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> dict:
    start, tokens = time.perf_counter(), []
    for batch in batches:
        tokens += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / elapsed, "s": elapsed}


def acceptance(before: dict, after: dict) -> dict:
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
        "num_drafts": drafts,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "max_num_seqs_to_speculate": args.max_to_speculate,
    }
    plain = LLM(args.model, dtype="float32", seed=0)
    fast = LLM(args.model, dtype="float32", seed=0, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {
        "rewrite, one at a time": [[p] for p in rewrite_prompts(plain, args.rewrites)],
        f"{args.random} random prompts at once": [
            random_prompts(args.random, plain.model_config.vocab_size)
        ],
    }
    for name, batches in workloads.items():
        base = run(plain, batches, params)
        before = fast.stats()
        spec_run = run(fast, batches, params)
        report = {
            "workload": name,
            "plain_tok_s": round(base["tok_s"], 1),
            "spec_tok_s": round(spec_run["tok_s"], 1),
            "ratio": round(spec_run["tok_s"] / base["tok_s"], 3),
            "same_tokens": base["tokens"] == spec_run["tokens"],
            **acceptance(before, fast.stats()),
        }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
