"""Whole-block data movement: copy-on-write within the cache, swap to and from a CPU pool.

Both go through one gather/scatter kernel over caches viewed as [num_layers * 2, num_blocks,
block_numel] (layer, K/V, then one block's block_size * num_kv_heads * head_dim elements):

    dst[layer_kv, dst_ids[pair], :] = src[layer_kv, src_ids[pair], :]   for every pair, layer_kv

Swap between devices gathers the source blocks into a contiguous staging buffer on the source
device, moves it with one copy (pinned host memory on the CPU side), and scatters it on the
destination device; the CPU side of such a swap uses torch indexing, as Triton kernels run on
the GPU only. Without CUDA both caches are on the CPU and the kernel runs in the interpreter.
"""

import torch
import triton
import triton.language as tl
from kvpager.kernels.reference import as_bytes

CHUNK = 1024  # elements copied per loop step


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_layer,
    stride_src_block,
    stride_dst_layer,
    stride_dst_block,
    stride_src_ids,
    stride_dst_ids,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair_idx, layer_kv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    src_block = tl.load(src_ids_ptr + pair_idx * stride_src_ids).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair_idx * stride_dst_ids).to(tl.int64)
    src = src_ptr + layer_kv * stride_src_layer + src_block * stride_src_block
    dst = dst_ptr + layer_kv * stride_dst_layer + dst_block * stride_dst_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _blocks_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, kvh, d] -> [num_layers * 2, num_blocks, numel];
    an fp8 cache as bytes (blocks move as they are; torch has no index_copy_ for fp8)."""
    assert cache.dim() == 6, f"expected a 6-d kv cache, got shape {tuple(cache.shape)}"
    assert cache.is_contiguous(), "the kv cache must be contiguous"
    return as_bytes(cache).view(cache.shape[0] * 2, cache.shape[2], -1)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids) -> None:
    """dst[:, dst_ids] = src[:, src_ids] on [layers * 2, blocks, numel] views, one launch."""
    assert src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2], "layout mismatch"
    assert src.dtype == dst.dtype and src.device == dst.device
    if src_ids.numel() == 0:
        return
    _copy_blocks_kernel[(src_ids.numel(), src.shape[0])](
        src, dst, src_ids, dst_ids,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        src_ids.stride(0), dst_ids.stride(0),
        BLOCK_NUMEL=src.shape[2], CHUNK=CHUNK,
    )  # fmt: skip


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks within one cache, every layer, K and V (copy-on-write).

    kv_cache: contiguous [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
    block_mapping: int64 [num_pairs, 2] of (src_block, dst_block), on the cache's device or
    the CPU; no dst is also a src (programs run concurrently). One launch, one program per
    (pair, layer, K/V).
    """
    blocks = _blocks_view(kv_cache)
    mapping = block_mapping.to(kv_cache.device)
    _launch_copy(blocks, blocks, mapping[:, 0], mapping[:, 1])


def _gather(blocks: torch.Tensor, ids: torch.Tensor, pin: bool) -> torch.Tensor:
    """[layers * 2, len(ids), numel] staging copy of the listed blocks, on blocks' device."""
    shape = (blocks.shape[0], ids.numel(), blocks.shape[2])
    staging = torch.empty(shape, dtype=blocks.dtype, device=blocks.device, pin_memory=pin)
    if blocks.is_cuda:
        ids = ids.to(blocks.device)
        _launch_copy(blocks, staging, ids, torch.arange(ids.numel(), device=blocks.device))
    else:
        torch.index_select(blocks, 1, ids, out=staging)
    return staging


def _scatter(staging: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor) -> None:
    """blocks[:, ids] = staging, on blocks' device."""
    if blocks.is_cuda:
        ids = ids.to(blocks.device)
        _launch_copy(staging, blocks, torch.arange(ids.numel(), device=blocks.device), ids)
    else:
        blocks.index_copy_(1, ids, staging)


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Move whole blocks between two caches (device <-> CPU pool), every layer, K and V.

    src_cache, dst_cache: contiguous [num_layers, 2, num_blocks_*, block_size, num_kv_heads,
    head_dim], same dtype, possibly on different devices; block_mapping: int64 [num_pairs, 2]
    of (block in src_cache, block in dst_cache), on the CPU. Batched: one gather, at most one
    device <-> host copy, one scatter. Synchronous for device -> host; host -> device is
    ordered on the current stream before any later kernel.
    """
    src, dst = _blocks_view(src_cache), _blocks_view(dst_cache)
    if block_mapping.numel() == 0:
        return
    src_ids, dst_ids = block_mapping[:, 0].contiguous(), block_mapping[:, 1].contiguous()
    if src.device == dst.device:
        _launch_copy(src, dst, src_ids.to(src.device), dst_ids.to(dst.device))
        return
    staging = _gather(src, src_ids, pin=src.device.type == "cpu")
    if dst.device.type == "cpu":
        host = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
        host.copy_(staging)  # synchronous device -> pinned host
        _scatter(host, dst, dst_ids)
    else:
        _scatter(staging.to(dst.device, non_blocking=True), dst, dst_ids)
