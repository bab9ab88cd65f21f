"""Decode-sized linears from DRAM: GB/s of weight read by oneDNN's packed matmul against the
C kernel that reads the same packed buffer (kernels/small_linear.py), SmolLM2-135M's shapes,
rows M, bf16 and fp32; lscpu flags printed first.

    python -m benchmarks.kernels.small_linears [--threads 2] [--rows 1,2,4,8,16,32,64]

Each shape cycles through enough copies of its weight (30 layers' worth; 3 lm_heads) that every
call reads from DRAM, not cache. The two paths take turns, round after round; each number is
the fastest round's mean call (a loaded host only makes a round slower). `--smoke`: a tiny run.
"""

import argparse
import time

import torch
from kvpager.engine.model.linear import pack_weight, packed_linear
from kvpager.kernels import small_linear

from benchmarks.kernels.packed_linears import SHAPES
from benchmarks.kernels.tier_reads import lscpu_flags

LAYERS = 30


def _round_s(fn, weights, x) -> float:
    start = time.perf_counter()
    for weight in weights:
        fn(x, weight)
    return (time.perf_counter() - start) / len(weights)


def onednn_and_kernel_us(
    out_f: int, in_f: int, rows_list: list[int], dtype: torch.dtype, rounds: int, copies: int
) -> list[tuple[float, float]]:
    """(oneDNN µs, kernel µs) a call per M, fastest round of `rounds`, alternated."""
    gen = torch.Generator().manual_seed(0)
    plain = [(torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype) for _ in range(copies)]
    packed = [pack_weight(w) for w in plain]
    views = [small_linear.view_packed(w, p) for w, p in zip(plain, packed)]
    del plain
    assert all(v is not None for v in views), "oneDNN chose another layout on this host"
    results = []
    for rows in rows_list:
        x = torch.randn(rows, in_f, generator=gen).to(dtype)
        paths = [
            (lambda x, p: packed_linear(x, p, None), packed),
            (lambda x, v: small_linear.small_linear(x, v, None), views),
        ]
        best = [float("inf")] * 2
        for _ in range(rounds):
            for idx, (fn, weights) in enumerate(paths):
                best[idx] = min(best[idx], _round_s(fn, weights, x) * 1e6)
        results.append((best[0], best[1]))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="M values, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="one small shape, 2 copies")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, rows = SHAPES, [int(m) for m in args.rows.split(",")]
    if args.smoke:
        shapes, rows, args.rounds = (("o_proj/8", 128, 64),), [1, 4], 2
    print(lscpu_flags())
    print(f"torch {torch.__version__}, {args.threads} threads; µs a call and GB/s of weight,")
    print("oneDNN packed / kernel (same packed buffer)")
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for name, out_f, in_f in shapes:
                copies = 2 if args.smoke else (3 if name == "lm_head" else LAYERS)
                timings = onednn_and_kernel_us(out_f, in_f, rows, dtype, args.rounds, copies)
                size = out_f * in_f * dtype.itemsize / 1e3  # GB/s = bytes / µs / 1e3
                cells = [
                    f"M={m}: {a:7.0f}/{b:7.0f}us {size / a:4.1f}/{size / b:4.1f} x{a / b:4.2f}"
                    for m, (a, b) in zip(rows, timings)
                ]
                print(f"{str(dtype)[6:]:8} {name:8} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
