"""Decode-sized linears from DRAM: GB/s of weight read by oneDNN's packed matmul against the
C kernel that reads the same packed buffer (kernels/small_linear.py), SmolLM2-135M's shapes,
rows M, bf16 and fp32; lscpu flags printed first.

    python -m benchmarks.kernels.small_linears [--threads 2] [--rows 1,2,4,8,16,32,64] \
        [--dtypes bfloat16,float32] [--step]

`--step`: one decode step's four decoder linears over 30 layers' own weights, ms a step, the
two paths alternated (what a step of the engine pays at M rows); for bf16 on a host where
oneDNN packs none, the bf16 weights blocked at load against plain `F.linear`.

Each shape cycles through enough copies of its weight (30 layers' worth; 3 lm_heads) that every
call reads from DRAM, not cache. The two paths take turns, round after round; each number is
the fastest round's mean call (a loaded host only makes a round slower). `--smoke`: a tiny run.
"""

import argparse
import time

import torch
import torch.nn.functional as F
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


# [out, in] of SmolLM2's four decoder linears: qkv, o_proj, gate_up, down
DECODER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _fastest_ms(steps, rounds: int) -> tuple[float, float]:
    """Each of two steps' fastest round in ms, the two alternated round by round."""
    best = [float("inf")] * 2
    for _ in range(rounds):
        for idx, step in enumerate(steps):
            start = time.perf_counter()
            step()
            best[idx] = min(best[idx], (time.perf_counter() - start) * 1e3)
    return best[0], best[1]


def step_ms(rows_list: list[int], dtype: torch.dtype, rounds: int) -> list[tuple[float, float]]:
    """(oneDNN ms, kernel ms) of one decode step's decoder linears, 30 layers, per M: each
    layer its own weights (so from DRAM), the two paths alternated, fastest round."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        plain = [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for o, i in DECODER]
        packed = [pack_weight(w) for w in plain]
        layers.append([(p, small_linear.view_packed(w, p)) for w, p in zip(plain, packed)])
    results = []
    for rows in rows_list:
        xs = [torch.randn(rows, i, generator=gen).to(dtype) for _, i in DECODER]
        steps = (
            lambda xs=xs: [packed_linear(x, p, None) for layer in layers
                           for x, (p, _) in zip(xs, layer)],
            lambda xs=xs: [small_linear.small_linear(x, v, None) for layer in layers
                           for x, (_, v) in zip(xs, layer)],
        )  # fmt: skip
        results.append(_fastest_ms(steps, rounds))
    return results


def blocked_step_ms(rows_list: list[int], rounds: int) -> list[tuple[float, float]]:
    """(F.linear ms, blocked-kernel ms) of one decode step's decoder linears in bf16, 30
    layers, per M: where oneDNN packs no bf16 (AVX2), the engine's path (block_bf16 and
    small_linear_bf16w) against the plain bf16 matmul it replaced."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        plain = [(torch.randn(o, i, generator=gen) * 0.05).bfloat16() for o, i in DECODER]
        layers.append([(w, small_linear.block_bf16(w)) for w in plain])
    results = []
    for rows in rows_list:
        xs = [torch.randn(rows, i, generator=gen).bfloat16() for _, i in DECODER]
        steps = (
            lambda xs=xs: [F.linear(x, w) for layer in layers for x, (w, _) in zip(xs, layer)],
            lambda xs=xs: [small_linear.small_linear_bf16w(x, b, None) for layer in layers
                           for x, (_, b) in zip(xs, layer)],
        )  # fmt: skip
        results.append(_fastest_ms(steps, rounds))
    return results


def print_steps(rows: list[int], dtype: torch.dtype, rounds: int) -> None:
    flops = sum(2 * o * i for o, i in DECODER) * LAYERS
    print(f"{str(dtype)[6:]}: a decode step's decoder linears (30 layers, from DRAM), ms")
    print("| M | oneDNN ms | kernel ms | oneDNN / kernel | kernel GFLOP/s |\n|---|---|---|---|---|")
    for m, (a, b) in zip(rows, step_ms(rows, dtype, rounds)):
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {flops * m / b / 1e6:.0f} |", flush=True)


def print_blocked_steps(rows: list[int], rounds: int) -> None:
    flops = sum(2 * o * i for o, i in DECODER) * LAYERS
    print("bfloat16 blocked at load (block_bf16): a decode step's decoder linears, ms")
    print("| M | F.linear ms | kernel ms | F.linear / kernel | kernel GFLOP/s |")
    print("|---|---|---|---|---|")
    for m, (a, b) in zip(rows, blocked_step_ms(rows, rounds)):
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {flops * m / b / 1e6:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="M values, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--smoke", action="store_true", help="one small shape, 2 copies")
    parser.add_argument("--step", action="store_true", help="whole decode steps, not shapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, rows = SHAPES, [int(m) for m in args.rows.split(",")]
    if args.smoke:
        shapes, rows, args.rounds = (("o_proj/8", 128, 64),), [1, 4], 2
    print(lscpu_flags())
    print(f"torch {torch.__version__}, {args.threads} threads; µs a call and GB/s of weight,")
    print("oneDNN packed / kernel (same packed buffer)")
    with torch.inference_mode():
        for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
            if pack_weight(torch.zeros(64, 64, dtype=dtype)) is None:
                print(f"{str(dtype)[6:]}: oneDNN does not pack it on this host (no native path)")
                if args.step and dtype == torch.bfloat16:
                    print_blocked_steps(rows, args.rounds)
                continue
            if args.step:
                print_steps(rows, dtype, args.rounds)
                continue
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
