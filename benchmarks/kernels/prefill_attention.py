"""Prefill attention on CPU: the C kernel (kernels/cpu/paged_prefill.c, read in place through
the block table) against the path it replaces (kernels/cpu_decode.py before it: SDPA over a
gathered copy of each chunk's context, reference.chunk_attention_ref; for a bf16 model, bf16
SDPA over a gathered copy), on SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64,
16-token blocks, one layer), one chunk at the end of each context.

    python -m benchmarks.kernels.prefill_attention [--contexts 512 1024 2048 4096] \
        [--chunks 256 512] [--dtypes float32 bfloat16] [--threads 2] [--out F.json]

Best of `--repeats` rounds, in ms per layer, the kernel and the old path taking turns on the
same inputs: wall time, and the process's CPU time (`*_cpu_ms`), which a loaded host inflates
far less (with --threads 1 it is the work itself; with more, OpenMP's spinning is in it too).
Read the ratios; the absolute numbers move with the host's load.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from kvpager.kernels import cpu_decode, cpu_prefill, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the results here as JSON")
    return parser.parse_args(argv)


def best_ms(fns: dict, repeats: int) -> dict:
    """Best wall and CPU ms of each function, the functions taking turns round by round."""
    best = {f"{name}_{kind}": float("inf") for name in fns for kind in ("ms", "cpu_ms")}
    for fn in fns.values():
        fn()  # warm up: builds, first touches
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            best[f"{name}_ms"] = min(best[f"{name}_ms"], wall * 1e3)
            best[f"{name}_cpu_ms"] = min(best[f"{name}_cpu_ms"], cpu * 1e3)
    return best


def make_inputs(context: int, chunk: int, dtype: torch.dtype) -> tuple:
    """One sequence whose last `chunk` tokens are new, its blocks scrambled in the cache."""
    num_blocks = -(-context // BLOCK)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    tables = torch.randperm(num_blocks).view(1, -1).int()
    query = torch.randn(chunk, HEADS, HEAD_DIM).to(dtype)
    cu_seqlens_q = torch.tensor([0, chunk], dtype=torch.int32)
    return query, key_cache, value_cache, tables, cu_seqlens_q, torch.tensor([context]).int()


def one_case(context: int, chunk: int, dtype: torch.dtype, repeats: int) -> dict:
    query, *rest = make_inputs(context, chunk, dtype)
    scale, chosen = HEAD_DIM**-0.5, torch.tensor([True])
    out = torch.empty(query.shape)

    def kernel():
        assert cpu_prefill.prefill_chunks(query, *rest, scale, 1, out)

    def old_path():
        if dtype == torch.bfloat16:
            bf16_out = torch.empty(query.shape, dtype=dtype)
            cpu_decode._bf16_chunk_attention(query, *rest, scale, chosen, bf16_out)
        else:
            reference.chunk_attention_ref(query, *rest, scale, chosen, out)

    times = best_ms({"kernel": kernel, "old": old_path}, repeats)
    row = dict(dtype=str(dtype).removeprefix("torch."), context=context, chunk=chunk)
    speedups = dict(
        speedup=times["old_ms"] / times["kernel_ms"],
        cpu_speedup=times["old_cpu_ms"] / times["kernel_cpu_ms"],
    )
    return row | {name: round(value, 3) for name, value in (times | speedups).items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        for context in args.contexts:
            for chunk in (c for c in args.chunks if c <= context):
                rows.append(one_case(context, chunk, getattr(torch, dtype), args.repeats))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
