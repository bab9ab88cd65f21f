"""The tile attention kernel alone (kernels/cpu/paged_tiles.c through cpu_tiles), SmolLM2's
shapes (9 query / 3 KV heads of 64, bf16, 30 layers, blocks scrambled): one 1,000-token
prefill, its two chunks at threshold 512, and a 64-sequence decode step at 320 tokens; best
of the rounds, ms for all 30 layers.

    BS=16 python benchmarks/reports/2026-12-06-xeon-amx-first-token/tile_attention.py
"""

import os
import time

import torch
from kvpager.kernels.cpu_tiles import paged_attention_tiles

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
BLOCK = int(os.environ.get("BS", 16))


def case(name: str, q_lens: list[int], seq_lens: list[int], rounds: int = 5) -> None:
    blocks = [(s + BLOCK - 1) // BLOCK for s in seq_lens]
    shape = (sum(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
    order = torch.randperm(sum(blocks)).int()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[at : at + n]
        at += n
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM).bfloat16()
    best = float("inf")
    for r in range(rounds + 1):  # the first warms up
        start = time.perf_counter()
        for key, value in caches:
            paged_attention_tiles(query, key, value, tables, cu, lens, 0.125, max(q_lens))
        if r:
            best = min(best, time.perf_counter() - start)
    print(f"{name}: {best * 1e3:.1f} ms (30 layers)", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    case("prefill 1000", [1000], [1000])
    case("prefill 512+488 (2nd chunk)", [488], [1000])
    case("prefill 512 (1st chunk)", [512], [512])
    case("decode 64x320", [1] * 64, [320] * 64, rounds=10)
