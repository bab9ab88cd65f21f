"""KV write: scatter the new tokens' K/V rows into the paged caches at their slots."""

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # next power of 2 of ROW_SIZE
    BLOCK_SIZE: tl.constexpr,
):
    token_idx = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_idx = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW_SIZE
    head_idx, dim_idx = offs // HEAD_DIM, offs % HEAD_DIM
    token = token_idx.to(tl.int64)
    key_src = token * stride_key_token + head_idx * stride_key_head + dim_idx
    value_src = token * stride_value_token + head_idx * stride_value_head + dim_idx
    dst = block_idx * stride_cache_block + block_offset * stride_cache_slot
    dst += head_idx * stride_cache_head + dim_idx
    key = tl.load(key_ptr + key_src, mask=mask)
    value = tl.load(value_ptr + value_src, mask=mask)
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into the paged caches at their slots; negative slots are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous (either may be a view
    into a fused qkv tensor); key_cache, value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], same strides, last dim contiguous (e.g. kv_cache[layer, 0/1]);
    slot_mapping: int32 or int64 [num_tokens], slot = block_id * block_size + offset, -1 for
    padding. Values are cast to the cache dtype. One program per token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key_cache.stride() == value_cache.stride(), "key and value caches must share strides"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), "cache heads/head_dim mismatch"
    assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    assert slot_mapping.shape == (num_tokens,), "one slot per token"
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        HEAD_DIM=head_dim,
        ROW_SIZE=row_size,
        ROW_PAD=triton.next_power_of_2(row_size),
        BLOCK_SIZE=key_cache.shape[1],
    )
