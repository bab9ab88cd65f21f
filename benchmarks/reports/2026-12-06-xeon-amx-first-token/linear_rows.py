"""Single bf16 calls with the weight in cache, SmolLM2's decoder linears: oneDNN's packed matmul
(`_linear_pointwise`) at many row counts (ns a row), and against the AMX kernel over the same
packed buffer (kernels/small_linear.py) at prefill sizes (µs a call, best of 25).

    PYTHONPATH=. python benchmarks/reports/2026-12-06-xeon-amx-first-token/linear_rows.py
"""

import torch
from kvpager.kernels import small_linear

from benchmarks.kernels.cpu_kernels import best_ms

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_us(fn) -> float:
    return best_ms(fn, 25) * 1e3


def onednn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def shape_rows(name: str, n: int, k: int) -> None:
    weight = torch.randn(n, k).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    rows = (488, 512, 992, 1000, 1008, 1024, 1040, 1536, 2048)
    rates = []
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        rates.append(best_us(lambda: onednn(x, packed)) / m)  # noqa: B023 (called at once)
    print(name, "oneDNN ns a row:", " ".join(f"{m}:{r * 1e3:.0f}" for m, r in zip(rows, rates)))
    view = small_linear.view_packed(weight, packed)
    assert view is not None and view.cols == small_linear.AMX_COLS, "an AMX host only"
    cells = []
    for m in (128, 512, 1000, 2048):
        x = torch.randn(m, k).bfloat16()
        a = best_us(lambda: onednn(x, packed))  # noqa: B023
        b = best_us(lambda: small_linear.small_linear(x, view, None))  # noqa: B023
        cells.append(f"{m}: {a:.0f} / {b:.0f} ({a / b:.2f}x)")
    print(name, "µs oneDNN / AMX kernel:", "; ".join(cells), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name, (n, k) in SHAPES.items():
        shape_rows(name, n, k)
