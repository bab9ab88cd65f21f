"""What the host's memory reads at, against what a decode step's linears stream their weights at.

A plain read (an fp32 sum, which the vector units keep up with) over buffers from L2-sized to
larger than the last-level cache gives the rate a memory-bound kernel could reach; SmolLM2's
four decoder linears (30 layers, each from memory) on oneDNN's packed weights (the engine's
`make_linear`) at decode-sized batches give what they get. Nothing else should run meanwhile.

    python -m benchmarks.kernels.memory_read [--threads 2] [--rows 8 16 32 64]
"""

import argparse

import torch
from kvpager.engine.model.linear import make_linear
from kvpager.kernels.isa import isa_flags

from benchmarks.kernels.cpu_kernels import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, best_ms

# (out, in) of the decoder's four linears: qkv, o_proj, gate_up, down
LINEARS = [
    ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    (HIDDEN, HEADS * HEAD_DIM),
    (2 * INTER, HIDDEN),
    (HIDDEN, INTER),
]


def read_rate(megabytes: int) -> float:
    """GB/s of an fp32 sum over `megabytes`, best of a few rounds."""
    x = torch.randn(megabytes * (1 << 20) // 4)
    ms = best_ms(x.sum, max(3, 2048 // megabytes))
    return x.numel() * 4 / ms / 1e6


def linear_rate(rows: int, repeats: int = 10) -> tuple[float, float]:
    """(ms a step, GB/s of weights) for SmolLM2's decoder linears at `rows` tokens, bf16."""
    layers = []
    for _ in range(LAYERS):
        weights = [torch.randn(out, inp).bfloat16() * 0.05 for out, inp in LINEARS]
        layers.append([make_linear(w, None)[0] for w in weights])
    inputs = {inp: torch.randn(rows, inp).bfloat16() for _, inp in LINEARS}

    def step() -> None:
        for linears in layers:
            for (_, inp), linear in zip(LINEARS, linears):
                linear(inputs[inp])

    ms = best_ms(step, repeats)
    weight_bytes = sum(out * inp * 2 for out, inp in LINEARS) * LAYERS
    return ms, weight_bytes / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ISA: {' '.join(isa_flags())}; {args.threads} threads")
    print("| read | GB/s |\n|---|---|")
    for megabytes in (2, 8, 32, 128, 256, 512, 1024):
        print(f"| fp32 sum over {megabytes} MB | {read_rate(megabytes):.1f} |")
    print(
        "\n| SmolLM2 decode linears, bf16 (oneDNN) | ms a step | GB/s of weights |\n|---|---|---|"
    )
    for rows in args.rows:
        ms, rate = linear_rate(rows)
        print(f"| {rows} rows | {ms:.2f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
