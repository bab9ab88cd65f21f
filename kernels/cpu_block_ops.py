"""swap_blocks for caches on the host: whole blocks moved as runs of copies, in C
(kernels/cpu/block_copy.c) where it builds, else as torch slice copies.

The twin (kernels/reference.py's swap_blocks_ref) gathers through advanced indexing: one
intermediate tensor of every moved block, then an index_put, about a sixth of what the host
copies. Here the pairs are sorted and split into runs where both the source and the
destination ids go up by one (blocks allocated together mostly are), and each run moves with
one copy a row of [layers * 2, run, block bytes], straight from cache to cache:

    pairs (3, 10) (4, 11) (5, 12) (9, 2)   ->   dst[:, 10:13] = src[:, 3:6];  dst[:, 2] = src[:, 9]

`copy_block_in` lands one block (a disk file's, [layers, 2, block_size, ...]) in a cache the
same way. Byte for byte the twin's result (tests/kernels/test_cpu_block_ops.py). A cache on a
CUDA device on either side falls back to the twin's path (kernels/block_ops.py serves CUDA).
"""

import torch
from kvpager.kernels.cpu_build import I64, NATIVE, PTR, load_library
from kvpager.kernels.reference import swap_blocks_ref

_SIGNATURES = (("copy_block_runs", (PTR, I64, PTR, I64, I64, I64, PTR, I64, I64)),)


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/block_copy.c) for `march`, or None."""
    return load_library("block_copy", _SIGNATURES, march)


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
    runs = block_runs(block_mapping)
    copy_runs(_blocks_view(src_cache), _blocks_view(dst_cache), runs, torch.get_num_threads())


def copy_block_in(block: torch.Tensor, cache: torch.Tensor, block_id: int) -> None:
    """cache[:, :, block_id] = block, for a host block of the cache's block shape and dtype
    (one thread: disk reader threads call it side by side); a block that is not contiguous
    (a snapshot's slice) copies as torch copies it."""
    assert block.dtype == cache.dtype, "a block of the cache's dtype"
    assert block.shape == cache.shape[:2] + cache.shape[3:], "a block of the cache's shape"
    if not block.is_contiguous():
        cache[:, :, block_id].copy_(block)
        return
    rows = block.view(torch.uint8).view(cache.shape[0] * cache.shape[1], 1, -1)
    copy_runs(rows, _blocks_view(cache), [(0, block_id, 1)], num_threads=1)


def copy_runs(
    src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]], num_threads: int
) -> None:
    """dst[:, d : d + n] = src[:, s : s + n] for each run (s, d, n) of [rows, blocks, block
    bytes] uint8 views whose blocks are contiguous; in C when it is built."""
    num_rows, block_bytes = src.shape[0], src.shape[2]
    assert dst.shape[0] == num_rows and dst.shape[2] == block_bytes, "caches of one layout"
    assert src.stride()[1:] == (block_bytes, 1) and dst.stride()[1:] == (block_bytes, 1)
    table = torch.tensor(runs, dtype=torch.int64).view(-1, 3)
    starts, lengths = table[:, :2], table[:, 2:]
    assert bool((lengths > 0).all()) and bool((starts >= 0).all()), "an empty or negative run"
    ends = (starts + lengths).amax(dim=0).tolist() if runs else [0, 0]
    assert ends[0] <= src.shape[1] and ends[1] <= dst.shape[1], "a block past the end"
    library = load()
    if library is None:
        for src_start, dst_start, length in runs:
            dst[:, dst_start : dst_start + length].copy_(src[:, src_start : src_start + length])
        return
    status = library.copy_block_runs(
        dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), num_rows, block_bytes,
        table.data_ptr(), len(runs), max(1, num_threads),
    )  # fmt: skip
    assert status == 0, "copy_block_runs refused its sizes"


def _blocks_view(cache: torch.Tensor) -> torch.Tensor:
    """[layers, 2, blocks, ...] -> [layers * 2, blocks, block bytes], as bytes (blocks move as
    they are, whatever the dtype)."""
    assert cache.is_contiguous(), "the kv cache must be contiguous"
    return cache.view(torch.uint8).view(cache.shape[0] * cache.shape[1], cache.shape[2], -1)
