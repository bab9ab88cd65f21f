"""fp8 KV cache against the bf16 cache on the real SmolLM2: blocks at the same memory, greedy
closeness in vLLM's check_logprobs_close sense, and the K/V magnitudes the scales face.

    python -m benchmarks.fp8_cache [--model smollm2-135m-instruct] [--kv-cache-memory 64MiB]
        [--tokens 64] [--backend cpu] [--dtypes fp8,fp8_e5m2] [--scales one,vllm,max]

The model runs in bfloat16 (the weights and compute the same for every cache); each cache gets
the same `kv_cache_memory`. For 8 chat prompts it prints each cache's block count, how many
greedy tokens equal the bf16 cache's, where the first difference falls and whether each side's
token is in the other's top 5 there, and the largest |K| and |V| the bf16 cache holds (what a
scale of 1.0 must cover: e4m3 reaches 448, e5m2 57344). `--scales` compares the default 1.0
("one") with scales calibrated per layer from that bf16 cache, as vLLM's calculate_kv_scales
would on a first prefill: "vllm" is max|K| / 200 and max|V| / 100 (its K_SCALE_CONSTANT and
V_SCALE_CONSTANT), "max" is max-abs / the format's largest value; it prints the mean
|difference| of the first token's logprob (same context for both caches) beside the rest.
"""

import argparse
import time

import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.download import resolve_model
from kvpager.engine.kv.kv_size import parse_bytes
from kvpager.kernels.isa import isa_flags
from transformers import AutoTokenizer

CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain what a hash table is in two sentences.",
    "List three uses of a paged KV cache.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish and French.",
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default="64MiB")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--dtypes", default="fp8,fp8_e5m2")
    parser.add_argument("--scales", default="one")
    return parser.parse_args(argv)


def _top_ids(entry, top: int) -> list[int]:
    """The `top` most likely token ids of one token's vLLM-shaped logprobs."""
    return [token_id for token_id, lp in entry.items() if lp.rank is not None and lp.rank <= top]


def _first_logprob(output) -> float:
    return output.logprobs[0][output.token_ids[0]].logprob


def first_difference(ref, got, top: int = 5) -> tuple[int, bool]:
    """(tokens equal before the first difference, whether each token there is in the other's
    top `top`; True when there is no difference)."""
    for idx, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        if a != b:
            close = b in _top_ids(ref.logprobs[idx], top) and a in _top_ids(got.logprobs[idx], top)
            return idx, close
    return len(ref.token_ids), True


def run(path, prompts, kv_cache_dtype: str, args, scales=None) -> tuple[LLM, list, float]:
    llm = LLM(
        str(path),
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        attention_backend=args.backend,
        block_size=16,
    )
    if scales is not None:  # calibrated: replaces the checkpoint's (none here) before any write
        for layer, (k_scale, v_scale) in zip(llm.executor.model.layers, scales, strict=True):
            layer.k_scale, layer.v_scale = k_scale, v_scale
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)
    started = time.perf_counter()
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return llm, outputs, time.perf_counter() - started


def largest_kv(llm: LLM) -> list[tuple[float, float]]:
    """max |K|, max |V| of each layer over the whole bf16 cache (unwritten blocks are zeros)."""
    cache = llm.executor.kv_cache.float()  # [layers, 2, blocks, ...]
    largest = cache.abs().flatten(2).max(dim=2).values
    return [(k, v) for k, v in largest.tolist()]


def calibrated(largest: list[tuple[float, float]], how: str, dtype_name: str):
    """Per-layer (k_scale, v_scale) for `how` ("one": None, the default 1.0)."""
    if how == "one":
        return None
    if how == "vllm":
        return [(k / 200, v / 100) for k, v in largest]
    top = torch.finfo(torch.float8_e5m2 if dtype_name == "fp8_e5m2" else torch.float8_e4m3fn).max
    return [(k / top, v / top) for k, v in largest]


def report(name: str, how: str, llm: LLM, base: LLM, expected, got, seconds, tokens) -> None:
    ratio = llm.executor.num_blocks / base.executor.num_blocks
    blocks = f"{llm.executor.num_blocks} blocks ({ratio:.2f}x)"
    print(f"{name} cache, scales {how}: {blocks}, {seconds:.1f} s")
    results = [first_difference(ref, out) for ref, out in zip(expected, got, strict=True)]
    equal = " ".join(str(agreed) for agreed, _ in results)
    print(f"  tokens equal before the first difference, per prompt (of {tokens}): {equal}")
    drift = [abs(_first_logprob(r) - _first_logprob(o)) for r, o in zip(expected, got)]
    print(f"  first token's mean |logprob difference|: {sum(drift) / len(drift):.3f}")
    close = sum(c for _, c in results)
    print(f"  close (check_logprobs_close, top 5): {close}/{len(results)} prompts")


def main(argv=None) -> None:
    args = parse_args(argv)
    path = resolve_model(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
        )
        for chat in CHATS
    ]
    print(f"host: {torch.get_num_threads()} threads, {' '.join(isa_flags())}")
    base, expected, seconds = run(path, prompts, "auto", args)
    largest = largest_kv(base)
    k_max, v_max = max(k for k, _ in largest), max(v for _, v in largest)
    print(f"bf16 cache: {base.executor.num_blocks} blocks, {seconds:.1f} s (first run: warm-up)")
    print(f"  largest |K| {k_max:.2f}, |V| {v_max:.2f} (of any layer)")
    for name in args.dtypes.split(","):
        for how in args.scales.split(","):
            llm, got, seconds = run(path, prompts, name, args, calibrated(largest, how, name))
            report(name, how, llm, base, expected, got, seconds, args.tokens)
            llm.check_invariants()
    base.check_invariants()


if __name__ == "__main__":
    main()
