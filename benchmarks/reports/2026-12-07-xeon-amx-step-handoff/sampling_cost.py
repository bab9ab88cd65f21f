"""A 64-row SmolLM2 step's sampling at temperature 1 (vocab 49,152, 2 threads): the float copy
of bf16 logits, the C draw over float32 and over bf16 (no copy), ms a call, mean of 50.

    python benchmarks/reports/2026-12-07-xeon-amx-step-handoff/sampling_cost.py
"""

import time

import torch
from kvpager.engine.worker.host_malloc import retain_freed_memory
from kvpager.kernels import cpu_sampling


def ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    retain_freed_memory()
    torch.set_num_threads(2)
    logits = (torch.randn(64, 49_152, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    inv_t, u = torch.ones(64), torch.rand(64, generator=torch.Generator().manual_seed(1))
    wide = logits.float()
    print(f"float copy {ms(lambda: logits.float()):.3f} ms; "
          f"draw over float32 {ms(lambda: cpu_sampling.draw(wide, inv_t, u)):.3f} ms; "
          f"copy + draw {ms(lambda: cpu_sampling.draw(logits.float(), inv_t, u)):.3f} ms; "
          f"draw over bf16 {ms(lambda: cpu_sampling.draw(logits, inv_t, u)):.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
