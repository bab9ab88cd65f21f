"""swap_blocks for caches on the host: whole blocks moved as runs of slice copies.

The twin (kernels/reference.py's swap_blocks_ref) gathers through advanced indexing: one
intermediate tensor of every moved block, then an index_put, about a sixth of what the host
copies. Here the pairs are sorted and split into runs where both the source and the
destination ids go up by one (blocks allocated together mostly are), and each run moves with
one strided copy of [layers * 2, run, block numel], straight from cache to cache:

    pairs (3, 10) (4, 11) (5, 12) (9, 2)   ->   dst[:, 10:13] = src[:, 3:6];  dst[:, 2] = src[:, 9]

Byte for byte the twin's result (tests/kernels/test_cpu_block_ops.py). A cache on a CUDA
device on either side falls back to the twin's path (kernels/block_ops.py serves CUDA).
"""

import torch
from kvpager.kernels.reference import as_bytes, swap_blocks_ref


def block_runs(block_mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs covering the pairs, in dst order."""
    pairs = sorted(map(tuple, block_mapping.tolist()), key=lambda pair: pair[1])
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            run_src, run_dst, length = runs[-1]
            if src == run_src + length and dst == run_dst + length:
                runs[-1] = (run_src, run_dst, length + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def swap_blocks_cpu(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """swap_blocks_ref's contract (int64 [num_pairs, 2] of (src block, dst block), on the CPU),
    for host caches: one copy a run of consecutive blocks, no intermediate."""
    if block_mapping.numel() == 0:
        return
    if src_cache.device.type != "cpu" or dst_cache.device.type != "cpu":
        swap_blocks_ref(src_cache, dst_cache, block_mapping)
        return
    src, dst = _blocks_view(src_cache), _blocks_view(dst_cache)
    for src_start, dst_start, length in block_runs(block_mapping):
        dst[:, dst_start : dst_start + length].copy_(src[:, src_start : src_start + length])


def _blocks_view(cache: torch.Tensor) -> torch.Tensor:
    """[layers, 2, blocks, ...] -> [layers * 2, blocks, block bytes] (fp8 as bytes too)."""
    assert cache.is_contiguous(), "the kv cache must be contiguous"
    return as_bytes(cache).view(cache.shape[0] * cache.shape[1], cache.shape[2], -1)
