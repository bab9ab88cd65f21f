"""The tile attention of a 64-sequence decode step's layer (300 keys each, SmolLM2's 9/3/64
heads, bf16 tile cache): fp32 rows then torch's conversion to bf16, against the kernel storing
bf16 rows itself (paged_attention_tiles_bf16_out), mean of 200 calls, 2 threads, 8 rounds.

    python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/attention_out.py
"""

import torch
from decode_setup import mean_call_s
from kvpager.kernels import cpu_tiles
from kvpager.kernels.cpu_tiles import to_tiles

SEQS, CONTEXT, BLOCK = 64, 300, 16


def main() -> None:
    torch.set_num_threads(2)
    per_seq = -(-CONTEXT // BLOCK)
    shape = (SEQS * per_seq + 1, BLOCK, 3, 64)
    key_cache = to_tiles(torch.randn(shape).bfloat16(), False)
    value_cache = to_tiles(torch.randn(shape).bfloat16(), True)
    tables = torch.arange(1, 1 + SEQS * per_seq, dtype=torch.int32).view(SEQS, per_seq)
    seq_lens = torch.full((SEQS,), CONTEXT, dtype=torch.int32)
    starts = torch.arange(SEQS + 1, dtype=torch.int32)
    query = torch.randn(SEQS, 9, 64).bfloat16()
    args = (query, key_cache, value_cache, tables, starts, seq_lens, 0.125, 0, 0.0)
    for _ in range(8):
        fp32 = 1e6 * mean_call_s(lambda: cpu_tiles._tile_attention(*args).bfloat16(), 200)
        bf16 = 1e6 * mean_call_s(
            lambda: cpu_tiles._tile_attention(*args, None, torch.bfloat16), 200
        )
        print(f"fp32 rows + .bfloat16(): {fp32:.1f} us, bf16 rows stored: {bf16:.1f} us")


if __name__ == "__main__":
    main()
