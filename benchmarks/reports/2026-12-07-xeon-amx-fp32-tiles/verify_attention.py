"""Attention of one sequence's verify chunk (2-24 query tokens) over 500-3,000 keys, SmolLM2's
9/3/64 heads, fp32 and bf16 token-major caches, 30 calls (a step's layers), best of 3: the
row-per-token kernel (the prefill kernel's minimum at 8, as it was for every cache) against
the prefill kernel (its minimum set to 2). `prefill_min_chunk` now takes the prefill kernel for
an fp32 cache from 3 tokens (PREFILL_MIN_CHUNK_F32).

    python benchmarks/reports/2026-12-07-xeon-amx-fp32-tiles/verify_attention.py
"""

import time

import torch
from kvpager.kernels import cpu_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def one_chunk(q_len: int, context: int, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-context // BLOCK) + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[None].int()
    query = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    cu_seqlens_q, seq_lens = torch.tensor([0, q_len]).int(), torch.tensor([context]).int()
    return query, key_cache, value_cache, table, cu_seqlens_q, seq_lens


def best_ms(args: tuple, q_len: int, calls: int = 30) -> tuple[float, torch.Tensor]:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            out = cpu_decode.paged_attention_cpu(*args, 0.125, q_len)
        best = min(best, time.perf_counter() - start)
    return best * 1e3, out


def set_minimum(tokens: int) -> None:
    cpu_decode.PREFILL_MIN_CHUNK = cpu_decode.PREFILL_MIN_CHUNK_F32 = tokens


if __name__ == "__main__":
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for context in (500, 1500, 3000):
            for q_len in (2, 3, 5, 8, 16, 24):
                args = one_chunk(q_len, context, dtype)
                set_minimum(8)
                rows_ms, rows = best_ms(args, q_len)
                set_minimum(2)
                kernel_ms, kernel = best_ms(args, q_len)
                diff = (rows.float() - kernel.float()).abs().max().item()
                print(
                    f"{dtype} ctx {context} q {q_len}: 30 layers rows-path(min 8) {rows_ms:.2f} "
                    f"ms, prefill kernel {kernel_ms:.2f} ms -> {rows_ms / kernel_ms:.2f}x "
                    f"(diff {diff:.1e})",
                    flush=True,
                )
