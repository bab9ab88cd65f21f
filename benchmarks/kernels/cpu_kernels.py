"""CPU kernel benchmark: the C kernels of the CPU backend against their torch twins, on the
shapes of one SmolLM2-135M decode step (64 sequences, 30 layers, 9 query / 3 KV heads).

    python -m benchmarks.kernels.cpu_kernels [--seqs 64] [--context 230] [--threads 2] \
        [--out F.json]

Decode attention is also set against a memory floor: summing the same K/V bytes as one
contiguous tensor (no paging, no math), the fastest this machine reads them. Best of
`--repeats` rounds; this machine's speed drifts, so read the ratios, which come from one run.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from kvpager.engine.worker.host_malloc import retain_freed_memory
from kvpager.kernels import cpu_decode, cpu_layer_ops, reference

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 30, 9, 3, 64, 576, 1536, 16


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument(
        "--context",
        type=int,
        default=230,
        help="longest context; lengths drawn from [context - 100, context]",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the results here as JSON")
    return parser.parse_args(argv)


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def best_ms_synced(fn, args) -> float:
    """best_ms over `args.repeats`, waiting for the GPU after each call when `args.device` is
    CUDA (kernels launch asynchronously), rounded to microseconds."""

    def run():
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()

    return round(best_ms(run, args.repeats), 3)


def attention_rows(args, dtype) -> dict:
    """Per decode step (all layers): C kernel, torch twin, and the memory floor."""
    blocks_per_seq = -(-args.context // BLOCK)
    num_blocks = args.seqs * blocks_per_seq
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks).view(args.seqs, blocks_per_seq).int()
    seq_lens = torch.randint(max(1, args.context - 100), args.context + 1, (args.seqs,)).int()
    query = torch.randn(args.seqs, HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5

    def kernel():
        for key, value in caches:
            cpu_decode.paged_decode(query, key, value, tables, seq_lens, scale)

    def twin():
        for key, value in caches[:3]:  # ~10x slower: three layers, scaled up
            reference.decode_attention_ref(query, key, value, tables, seq_lens, scale)

    touched = int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2 * LAYERS  # K and V elements read
    stream = torch.randn(touched).to(dtype)
    row = {
        "cache_dtype": str(dtype).removeprefix("torch."),
        "bytes_read_mb": round(touched * stream.element_size() / 1e6, 1),
        "c_kernel_ms": best_ms(kernel, args.repeats),
        "torch_twin_ms": best_ms(twin, max(2, args.repeats // 3)) * LAYERS / 3,
        "memory_floor_ms": best_ms(lambda: stream.sum(), args.repeats),
    }
    row["twin_over_kernel"] = row["torch_twin_ms"] / row["c_kernel_ms"]
    row["kernel_over_floor"] = row["c_kernel_ms"] / row["memory_floor_ms"]
    return row


def layer_op_rows(args) -> list[dict]:
    """Each per-layer op over one decode step's tokens, times 30 layers (x2 where a layer
    calls it twice), C against the twin."""
    tokens = args.seqs
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv.split([q_size, kv_size, kv_size], -1))
    angles = torch.rand(tokens, HEAD_DIM)
    cos, sin = angles.cos(), angles.sin()
    residual, delta, weight = (
        torch.randn(tokens, HIDDEN),
        torch.randn(tokens, HIDDEN),
        torch.ones(HIDDEN),
    )
    gate_up = torch.randn(tokens, 2 * INTER)
    cache = torch.zeros(2, tokens * 2, BLOCK, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(tokens * 2 * BLOCK)[:tokens]
    ops = {
        "reshape_and_cache": (
            1,
            lambda: cpu_layer_ops.reshape_and_cache(k, v, cache[0], cache[1], slots),
            lambda: reference.reshape_and_cache_ref(k, v, cache[0], cache[1], slots),
        ),
        "rotary": (
            1,
            lambda: cpu_layer_ops.rotary(q, k, cos, sin),
            lambda: reference.rotary_ref(q, k, cos, sin),
        ),
        "add_rms_norm": (
            2,
            lambda: cpu_layer_ops.add_rms_norm(residual.clone(), delta, weight, 1e-5),
            lambda: reference.add_rms_norm_ref(residual.clone(), delta, weight, 1e-5),
        ),
        "silu_and_mul": (
            1,
            lambda: cpu_layer_ops.silu_and_mul(gate_up),
            lambda: reference.silu_and_mul_ref(gate_up),
        ),
    }
    rows = []
    for name, (per_layer, c_op, twin_op) in ops.items():
        calls = LAYERS * per_layer
        c_ms = best_ms(lambda op=c_op, n=calls: [op() for _ in range(n)], args.repeats)
        twin_ms = best_ms(lambda op=twin_op, n=calls: [op() for _ in range(n)], args.repeats)
        rows.append({"op": name, "c_ms": c_ms, "torch_twin_ms": twin_ms, "ratio": twin_ms / c_ms})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if cpu_decode.load() is None or cpu_layer_ops.load() is None:
        print("no C compiler here: the CPU backend runs its torch twins; nothing to compare")
        return 0
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as the executor does on a CPU device
    torch.manual_seed(0)
    print(f"one decode step: {args.seqs} sequences, context <= {args.context}, {LAYERS} layers")
    results = {"config": vars(args), "attention": [], "layer_ops": layer_op_rows(args)}
    for dtype in (torch.float32, torch.bfloat16):
        results["attention"].append(attention_rows(args, dtype))
    for row in results["attention"]:
        print(
            f"decode attention, {row['cache_dtype']} cache ({row['bytes_read_mb']} MB): C "
            f"{row['c_kernel_ms']:.1f} ms, torch twin {row['torch_twin_ms']:.1f} ms "
            f"({row['twin_over_kernel']:.2f}x), memory floor {row['memory_floor_ms']:.1f} ms "
            f"(kernel at {row['kernel_over_floor']:.2f}x the floor)"
        )
    for row in results["layer_ops"]:
        print(
            f"{row['op']:>17}: C {row['c_ms']:.2f} ms, torch twin {row['torch_twin_ms']:.2f} ms "
            f"({row['ratio']:.1f}x) per step"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
