"""Offline throughput on a CUDA device: kvpager's engine against transformers' batched
`generate` on the same random SmolLM2-shaped checkpoint, in one run.

    python -m benchmarks.gpu.throughput --out results/gpu_throughput.json

The checkpoint has SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV heads,
MLP 1,536) with the tests' small trained tokenizer (vocabulary 384): no model hub is reachable
from the GPU machine. Both engines are greedy, bf16, on the same prompts; transformers pads the
batch (left) and uses its default SDPA attention with a contiguous cache.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    initializer_range=0.02,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("-n", "--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    return parser.parse_args(argv)


def build_checkpoint(folder: Path) -> Path:
    from tests.models import build_llama

    return build_llama(folder, seed=0, **SMOLLM2_SHAPE)


def prompts(num: int, length: int, vocab_size: int = 384) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


def _time_kvpager(path: Path, batch: list[list[int]], output_len: int) -> dict:
    from kvpager.engine import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(batch[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.check_invariants()
    return _row("kvpager", seconds, tokens)


def _time_transformers(path: Path, batch: list[list[int]], output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(batch, device="cuda")  # equal lengths: no padding needed
    args = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    warm = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    model.generate(ids[:8], attention_mask=torch.ones_like(ids[:8]), **warm)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "engine": "transformers",
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
    }


def _row(engine: str, seconds: float, tokens: int) -> dict:
    return {"engine": engine, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    batch = prompts(args.num_requests, args.input_len)
    with tempfile.TemporaryDirectory() as folder:
        path = build_checkpoint(Path(folder))
        results = [
            _time_kvpager(path, batch, args.output_len),
            _time_transformers(path, batch, args.output_len),
        ]
    ratio = results[0]["tok_s"] / results[1]["tok_s"]
    for row in results:
        took = f"{row['tokens']} in {row['seconds']:.2f} s"
        print(f"{row['engine']:>13}: {row['tok_s']:9.1f} tok/s ({took})")
    print(f"kvpager / transformers: {ratio:.2f}x")
    summary = {
        "device": torch.cuda.get_device_name(),
        "shape": "SmolLM2-135M (random weights)",
        "requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "results": results,
        "ratio": ratio,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
