"""fp32 linears on AMX tiles (kernels/cpu/amx_linear_f32.c) against oneDNN's packed matmul and
the AVX-512 small-row kernel (up to 128 rows), single calls of SmolLM2's shapes, 2 threads:
the fastest of 10 calls in µs, and each output's largest error against float64 beside
F.linear's (fp32). Prints the host's ISA flags first.

    python benchmarks/reports/2026-12-07-xeon-amx-fp32-tiles/tile_f32.py
"""

import time

import torch
import torch.nn.functional as F
from kvpager.kernels import small_linear
from kvpager.kernels.isa import isa_flags

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 16, 24, 32, 64, 128, 512, 1000, 2048)
LM_HEAD_ROWS = (16, 32, 64, 128)


def fastest_us(fn, calls: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def row(name: str, weight: torch.Tensor, rows: int) -> str:
    planes = small_linear.split_planes(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    view = small_linear.view_packed(weight, packed)
    x = torch.randn(rows, weight.shape[1])
    truth = F.linear(x.double(), weight.double())
    tiles_err = (small_linear.tile_linear_f32(x, planes, None).double() - truth).abs().max()
    fp32_err = (F.linear(x, weight).double() - truth).abs().max()
    tiles = fastest_us(lambda: small_linear.tile_linear_f32(x, planes, None))
    onednn = fastest_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    kernel = fastest_us(lambda: small_linear.small_linear(x, view, None)) if rows <= 128 else None
    best = min(onednn, kernel or onednn)
    return (
        f"| {name} | {rows} | {tiles:.0f} | {onednn:.0f} | "
        f"{'-' if kernel is None else f'{kernel:.0f}'} | {best / tiles:.2f}x | "
        f"{tiles_err:.1e} / {fp32_err:.1e} |"
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print("ISA:", " ".join(isa_flags()), "| torch", torch.__version__, "| 2 threads")
    print("| weight | rows | tiles µs | oneDNN µs | AVX-512 kernel µs | best other / tiles "
          "| max error vs float64: tiles / fp32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f) / in_f**0.5
        for rows in ROWS:
            print(row(name, weight, rows), flush=True)
    lm_head = torch.randn(49152, 576) / 24
    for rows in LM_HEAD_ROWS:
        print(row("lm_head", lm_head, rows), flush=True)
