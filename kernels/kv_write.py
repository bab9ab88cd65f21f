"""KV write: scatter the new tokens' K/V rows into the paged caches at their slots.

An fp8 cache is written as bytes (a uint8 view): each value x / scale is clamped to the format's
largest finite value and rounded to nearest even by integer arithmetic on its float32 bits,
the same steps as kernels/cpu/fp8.h, so the CUDA build, the interpreter and the C kernel store
the bytes torch's conversion does (the interpreter's own float -> fp8 cast loses the carry
when rounding up crosses a power of two: 1.96 became 1.0).
"""

import torch
import triton
import triton.language as tl

# fp8 format -> (mantissa bits, exponent bias, largest finite value)
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}
NO_FP8 = (0, 0, 0.0)


@triton.jit
def _quantise_fp8(
    x,
    scale,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,  # 2^(1 - BIAS)
    INV_STEP: tl.constexpr,  # 2^(BIAS - 1 + MANT): subnormal codes per unit
):
    """float32 values -> fp8 codes as uint8: x / scale, clamped, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x / scale, -MAX), MAX)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    abs_bits = bits & 0x7FFFFFFF
    odd = (abs_bits >> (23 - MANT)) & 1
    normal = ((abs_bits + ((1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # below the smallest normal, codes count subnormal steps
    a = abs_bits.to(tl.float32, bitcast=True)
    steps = (a * INV_STEP + 8388608.0) - 8388608.0  # rint, as floats
    sub = steps.to(tl.uint32)
    code = tl.where(a < MIN_NORMAL, sub, normal) | sign
    return code.to(tl.uint8)


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
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # next power of 2 of ROW_SIZE
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # an fp8 cache (uint8 view), in the format MANT, BIAS, MAX
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    INV_STEP: tl.constexpr,
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
    if FP8:
        key = _quantise_fp8(key.to(tl.float32), k_scale, MANT, BIAS, MAX, MIN_NORMAL, INV_STEP)
        value = _quantise_fp8(value.to(tl.float32), v_scale, MANT, BIAS, MAX, MIN_NORMAL, INV_STEP)
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V rows into the paged caches at their slots; negative slots are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous (either may be a view
    into a fused qkv tensor); key_cache, value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], same strides, last dim contiguous (e.g. kv_cache[layer, 0/1]);
    slot_mapping: int32 or int64 [num_tokens], slot = block_id * block_size + offset, -1 for
    padding. Values are cast to the cache dtype; an fp8 cache (float8_e4m3fn, float8_e5m2)
    stores clamp(x / k_scale or v_scale) rounded to nearest even. One program per token.
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
    fp8 = key_cache.dtype in FP8_FORMATS
    fp8_format = _fp8_constexprs(*FP8_FORMATS.get(key_cache.dtype, NO_FP8))
    if fp8:
        assert value_cache.dtype == key_cache.dtype, "key and value caches share a dtype"
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), k_scale, v_scale,
        HEAD_DIM=head_dim, ROW_SIZE=row_size, ROW_PAD=triton.next_power_of_2(row_size),
        BLOCK_SIZE=key_cache.shape[1], FP8=fp8, **fp8_format,
    )  # fmt: skip


def _fp8_constexprs(mant: int, bias: int, largest: float) -> dict:
    """The kernel's description of an fp8 format (zeros when the cache is not fp8)."""
    return dict(
        MANT=mant, BIAS=bias, MAX=largest,
        MIN_NORMAL=2.0 ** (1 - bias), INV_STEP=2.0 ** (bias - 1 + mant),
    )  # fmt: skip
