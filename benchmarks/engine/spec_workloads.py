"""The speculative-decoding benchmark's workloads, free of any engine: benchmarks/engine/
spec_decode.py runs them on kvpager and benchmarks/engine/spec_decode_vllm.py on vLLM (in
vLLM's own virtualenv, which lacks kvpager), so both engines get the same prompts and the same
agent loop.

- code rewrites, one request at a time: a function of the stdlib `json` package (text no one
  here wrote, read from its installed source) and the instruction to add type hints and keep
  the rest; the answer copies most of its prompt, which prompt lookup finds;
- an agent loop, one request at a time, three turns a file (from the end of FUNCTIONS, where
  the rewrites take theirs from the start): the rewrite; a follow-up in the
  same conversation (its answer in the history: add docstrings, answer with the whole
  function); then the rewrite asked again in a fresh conversation, as an agent retrying a
  step does; suffix decoding finds the third turn's answer in the first one's output, which
  its own tokens never hold;
- prompts of random token ids at once, where nothing can be looked up.
"""

import inspect
import json
import json.decoder
import json.encoder
import random
import time
from collections.abc import Callable

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
FOLLOW_UP = "Now also add a one-line docstring. Answer with the whole function, code only."

# one chat turn: messages -> (the answer's text, its token ids)
Ask = Callable[[list[dict]], tuple[str, list[int]]]


def rewrite_ask(function) -> str:
    source = inspect.getsource(function)
    return (
        "Rewrite this Python function with type hints added. Keep every line, name and "
        f"comment otherwise identical. Answer with the code only.\n\n```python\n{source}```"
    )


def rewrite_messages(functions: list) -> list[list[dict]]:
    return [[{"role": "user", "content": rewrite_ask(f)}] for f in functions]


def random_prompts(count: int, vocab_size: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def run_agent_loop(ask: Ask, count: int) -> dict:
    """Three turns a file, one request at a time; each turn's prompt depends on the answers
    (so each engine builds its own, from its own answers: the same when greedy tokens are)."""
    start, tokens = time.perf_counter(), []
    # the last functions, the rewrites the first: an engine that runs both keeps no answer
    # of one in its suffix cache for the other (vLLM's arms run every workload in one process)
    for first in rewrite_messages(FUNCTIONS[::-1][:count]):
        answer, token_ids = ask(first)
        tokens.append(token_ids)
        follow_up = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UP},
        ]
        tokens.append(ask(follow_up)[1])
        tokens.append(ask(first)[1])  # a fresh conversation: the same step retried
    return timed(start, tokens)


def run_batches(generate: Callable[[list[list[int]]], list[list[int]]], batches) -> dict:
    """`generate`: one batch of prompts -> their outputs' token ids."""
    start, tokens = time.perf_counter(), []
    for batch in batches:
        tokens += generate(batch)
    return timed(start, tokens)


def timed(start: float, tokens: list[list[int]]) -> dict:
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / elapsed, "s": elapsed}
