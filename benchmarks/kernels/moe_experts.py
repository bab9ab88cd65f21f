"""Routed experts on CPU: the torch twin (`fused_moe_ref`, plain `@` per expert) against the
oneDNN-packed runner (engine/model/packed_experts.py), on a Qwen3-MoE-like layer.

    python -m benchmarks.kernels.moe_experts [--threads 1] [--repeats 7]

H 512, I 256, 16 experts, top-2, T = 1, 16, 256 tokens; fp32, and bf16 where the CPU runs it
natively. Prints ms per call, the minimum over `--repeats` rounds (this machine is shared).
"""

import argparse
import time

import torch
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.moe import route
from kvpager.engine.model.packed_experts import PackedExperts
from kvpager.kernels import cpu_layer_ops
from kvpager.kernels.reference_moe import fused_moe_ref

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 16, 2


def best_ms(fns, repeats: int, calls: int) -> list[float]:
    """Each fn's best ms per call; the fns take turns in every round, so load hits all alike."""
    rounds = [[] for _ in fns]
    for _ in range(repeats + 1):  # the first round warms up
        for fn, times in zip(fns, rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e3)
    return [min(times[1:]) for times in rounds]


def bench(dtype: torch.dtype, num_tokens: int, repeats: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.05).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.05).to(dtype)
    weights, ids = route(torch.randn(num_tokens, EXPERTS, generator=gen).to(dtype), TOP_K, False)
    act = cpu_layer_ops.silu_and_mul
    packed = PackedExperts.pack(gate_up, down)
    calls = max(3, 200 // num_tokens)
    return best_ms(
        [
            lambda: fused_moe_ref(hidden, gate_up, down, weights, ids, act),
            lambda: packed(hidden, weights, ids, act),
        ],
        repeats,
        calls,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else [])
    with torch.inference_mode():
        for dtype in dtypes:
            for num_tokens in (1, 16, 256):
                twin, packed = bench(dtype, num_tokens, args.repeats)
                print(f"{str(dtype):15} T={num_tokens:<4} twin {twin:7.3f} ms  "
                      f"packed {packed:7.3f} ms  x{twin / packed:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
