"""Single calls with the weight in cache: oneDNN's packed matmul (`packed_linear`) against the
AMX kernel over the same packed buffer (kernels/small_linear.py), SmolLM2-135M's shapes, bf16,
2 threads, µs a call (the quarter-quantile of single calls; oneDNN's calls, then the kernel's).

    PYTHONPATH=. python benchmarks/reports/2026-12-06-xeon-amx-linears/single_calls.py
"""

import time

import torch
from kvpager.engine.model.linear import pack_weight, packed_linear
from kvpager.kernels import small_linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
ROWS = (1, 4, 16, 32, 33, 48, 64, 96, 128, 256)


def quarter_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 4] * 1e6


def main() -> None:
    torch.set_num_threads(2)
    print("| weight | M | oneDNN µs | AMX kernel µs | oneDNN / kernel |\n|---|---|---|---|---|")
    for name, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f).bfloat16() * 0.05
        packed = pack_weight(weight)
        view = small_linear.view_packed(weight, packed)
        assert view is not None and view.cols == small_linear.AMX_COLS, "not an AMX host"
        for rows in ROWS:
            x = torch.randn(rows, in_f).bfloat16()
            calls = 200 if rows <= 64 else 40
            onednn = quarter_us(lambda x=x, p=packed: packed_linear(x, p, None), calls)
            kernel = quarter_us(lambda x=x, v=view: small_linear.small_linear(x, v, None), calls)
            print(f"| {name} | {rows} | {onednn:.1f} | {kernel:.1f} | {onednn / kernel:.2f}x |")


if __name__ == "__main__":
    main()
