"""The draw of one sampled token for 64 rows of SmolLM2's 49,152 logits, temperatures in
[0.5, 1.5): the C draw (kernels/cpu_sampling.py) against its twin, torch's softmax, cumsum and
searchsorted (kernels/reference.py draw_ref), mean of 20 calls, 2 threads.

    python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/draw_alone.py
"""

import torch
from decode_setup import mean_call_s
from kvpager.kernels import cpu_sampling, reference


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen) * 3
    inv_temperature = 1 / (torch.rand(64, generator=gen) + 0.5)
    u = torch.rand(64, generator=gen)
    same = cpu_sampling.draw(logits, inv_temperature, u) == reference.draw_ref(
        logits, inv_temperature, u
    )
    print(f"same token as the twin: {int(same.sum())} of 64 rows")
    for _ in range(2):
        c = 1e3 * mean_call_s(lambda: cpu_sampling.draw(logits, inv_temperature, u), 20)
        twin = 1e3 * mean_call_s(lambda: reference.draw_ref(logits, inv_temperature, u), 20)
        print(f"C draw {c:.2f} ms, twin {twin:.2f} ms ({twin / c:.1f}x)")


if __name__ == "__main__":
    main()
