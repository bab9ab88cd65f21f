"""What the hardware allows: the host's measured matmul peak per dtype, and the throughput the
workload's linear layers would reach at that peak (the roofline). The ISA flags that decide
the peak are kvpager.kernels.isa's.

A decoder token costs 2 x (linear weights) FLOPs in its layers, and each sampled token 2 x
hidden x vocab more in the lm_head. At the matmul peak P (FLOP/s) a workload of T tokens
(prompt + output) and S sampled tokens takes (2 W T + 2 H V S) / P seconds; its output
tokens over that time is the roofline an engine's tok/s is a fraction of. Attention, norms
and sampling are left out, so no engine can reach it.
"""

import time

import torch
from kvpager.engine.model_config import ModelConfig

MATMUL_SIZE = 2048


def matmul_peak_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """Best GFLOP/s of a square matmul on this process's threads."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, packing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return round(2 * MATMUL_SIZE**3 / best / 1e9, 1)


def linear_flops(config: ModelConfig, num_tokens: int, num_sampled: int) -> float:
    """FLOPs of the decoder's matmuls for `num_tokens` tokens, `num_sampled` of them sampled."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = hidden * (config.num_heads + 2 * config.num_kv_heads) * head_dim
    out = config.num_heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    weights = config.num_layers * (qkv + out + mlp)
    return 2.0 * weights * num_tokens + 2.0 * hidden * config.vocab_size * num_sampled


def roofline(config: ModelConfig, workload_summary: dict, peak_gflops: float) -> dict:
    """The workload's linear FLOPs and the output tok/s they allow at the matmul peak."""
    prompt, output = workload_summary["num_prompt_tokens"], workload_summary["num_output_tokens"]
    flops = linear_flops(config, prompt + output, output)
    seconds = flops / (peak_gflops * 1e9)
    return {
        "linear_tflop": round(flops / 1e12, 3),
        "roofline_tok_s": round(output / seconds, 1),
    }
