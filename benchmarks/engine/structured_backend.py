"""Structured-output backends on SmolLM2's tokenizer (49,152 tokens): llguidance vs xgrammar.

    python -m benchmarks.engine.structured_backend [--model PATH] [--tokens 64] [--rounds 5]

For a realistic JSON schema (an order: nested object, enum, bounded strings and arrays, numbers),
a regex and a choice, it measures per backend: building its tokenizer view (once per process),
compiling the grammar (what a request without a cache hit waits for), and per generated token
the mask fill into a packed int32 bitmask plus the matcher's advance, walking a valid answer
token by token. It also prints how much a bitmask weighs on the wire (what the scheduler would
ship per structured request per step if the matchers lived there). xgrammar is measured only
when importable (`pip install --no-deps xgrammar apache-tvm-ffi`: its declared dependencies
pull another torch).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 12},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 10},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}
ORDER = {
    "order_id": "A-1042",
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "vip": True},
    "items": [
        {"sku": "KV-16", "quantity": 2, "price": 19.5},
        {"sku": "PA-4", "quantity": 1, "price": 7.25},
    ],
    "notes": "leave at the door",
}
REGEX = r"\d{3}-\d{4}"
DEFAULT_MODEL = Path.home() / ".cache/kvpager/models/smollm2-135m-instruct"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def bench_llguidance(tokenizer_json: str, answer_ids: list[int], rounds: int) -> dict:
    import llguidance

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json)
    tokenizer_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ORDER_SCHEMA))
    compile_s, fill_s = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.compute_bitmask()  # the first mask does the lexer's set-up work
        compile_s.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        for token_id in answer_ids:
            start = time.perf_counter()
            mask = matcher.compute_bitmask()
            assert matcher.consume_token(token_id), matcher.get_error()
            fill_s.append(time.perf_counter() - start)
    return _timings(tokenizer_s, compile_s, fill_s, len(mask))


def bench_xgrammar(tokenizer_dir: Path, vocab_size: int, answer_ids: list[int], rounds: int):
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    from transformers import AutoTokenizer

    start = time.perf_counter()
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    tokenizer_s = time.perf_counter() - start
    compile_s, fill_s = [], []
    bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
    for _ in range(rounds):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(ORDER_SCHEMA))
        compile_s.append(time.perf_counter() - start)
        matcher = xgr.GrammarMatcher(compiled)
        for token_id in answer_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token_id)
            fill_s.append(time.perf_counter() - start)
    return _timings(tokenizer_s, compile_s, fill_s, bitmask.nbytes)


def _timings(tokenizer_s: float, compile_s: list, fill_s: list, mask_bytes: int) -> dict:
    """One backend's row: tokenizer set-up, median compile, median and p90 mask+advance."""
    return {
        "tokenizer": tokenizer_s,
        "compile": statistics.median(compile_s),
        "fill": statistics.median(fill_s),
        "fill_p90": statistics.quantiles(fill_s, n=10)[-1],
        "mask_bytes": mask_bytes,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    tokenizer_json = (args.model / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    vocab_size = tokenizer.get_vocab_size()
    answer_ids = tokenizer.encode(json.dumps(ORDER), add_special_tokens=False).ids
    print(f"vocab {vocab_size}, answer {len(answer_ids)} tokens, rounds {args.rounds}")
    results = {"llguidance": bench_llguidance(tokenizer_json, answer_ids, args.rounds)}
    results["xgrammar"] = bench_xgrammar(args.model, vocab_size, answer_ids, args.rounds)
    for name, r in results.items():
        if r is None:
            print(f"{name}: not installed")
            continue
        print(
            f"{name}: tokenizer {_ms(r['tokenizer'])}, compile {_ms(r['compile'])}, "
            f"mask+advance per token p50 {r['fill'] * 1e6:.0f} us p90 {r['fill_p90'] * 1e6:.0f} us"
            f", bitmask {r['mask_bytes']} bytes a request a step"
        )


if __name__ == "__main__":
    main()
