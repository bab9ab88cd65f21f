"""Paged attention on CUDA: the launcher of the Triton kernels in
kernels/paged_attention_triton.py (their layout, masking, split-KV and fp8 widening are
described there), with the choice of split-KV and the checks of its inputs. Its torch twin is
kernels/reference.py's paged_attention_ref (tests/kernels/test_paged_attention.py)."""

import functools

import torch
import triton
from kvpager.kernels.paged_attention_triton import (
    LOG2E,
    _paged_attention_kernel,
    _reduce_splits_kernel,
)
from kvpager.kernels.reference import FP8_DTYPES

MIN_PARTITION_SIZE = 256  # tokens of context per split-KV program, at least
MAX_SPLITS = 64


@functools.lru_cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_context: int, num_sms: int
) -> int:
    """Split-KV only for decode-only batches too small to fill the GPU with long contexts.

    Aims at about two programs per SM, each partition at least MIN_PARTITION_SIZE tokens.
    """
    num_programs = num_seqs * num_kv_heads
    target = 2 * num_sms
    if max_seqlen_q != 1 or num_programs >= target or max_context < 2 * MIN_PARTITION_SIZE:
        return 1
    by_occupancy = -(-target // num_programs)
    return max(1, min(by_occupancy, max_context // MIN_PARTITION_SIZE, MAX_SPLITS))


def _check_inputs(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens):
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} KV heads"
    assert key_cache.shape[3] == query.shape[2], "query and cache head_dim differ"
    assert key_cache.dtype == value_cache.dtype, "key and value caches share a dtype"
    assert query.dtype == key_cache.dtype or key_cache.dtype in FP8_DTYPES, (
        "the caches are in the query's dtype, or fp8"
    )
    assert key_cache.stride() == value_cache.stride(), "key and value caches must share strides"
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()
    assert cu_seqlens_q.shape[0] == seq_lens.shape[0] + 1 == block_tables.shape[0] + 1


def _tile_sizes(group: int, max_seqlen_q: int) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q): at least 16 rows (tl.dot's minimum), 64 for prefill."""
    group_pad = triton.next_power_of_2(group)
    rows = 16 if max_seqlen_q == 1 else 64
    return group_pad, max(1, rows // group_pad)


def _partials(query: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, ...]:
    """Split-KV's per-partition outputs, running maxima and sums, reduced afterwards."""
    num_tokens, num_heads, head_dim = query.shape
    partial_m = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
    partial_l = torch.empty_like(partial_m)
    partial_out = partial_m.new_empty((*partial_m.shape, head_dim))
    return partial_out, partial_m, partial_l


def _sinks_on(query: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """sinks as the kernel reads them: fp32, contiguous, on query's device; one a head."""
    if sinks is None:
        return None
    assert sinks.shape == (query.shape[1],), f"sinks {tuple(sinks.shape)}: one a head"
    return sinks.to(device=query.device, dtype=torch.float32).contiguous()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    *,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over paged K/V.

    query: [num_tokens, num_heads, head_dim], sequences packed back to back, head_dim
    contiguous (a view into a fused qkv tensor is fine); key_cache, value_cache: [num_blocks,
    block_size, num_kv_heads, head_dim], same strides, head_dim contiguous; block_tables:
    int32 [num_seqs, max_blocks_per_seq], rows contiguous; cu_seqlens_q: int32 [num_seqs + 1];
    seq_lens: int32 [num_seqs], context lengths including the new tokens (already cached);
    max_seqlen_q: the longest query chunk (host int, sizes the grid). Returns a contiguous
    [num_tokens, num_heads, head_dim] tensor in query's dtype.

    num_splits: None lets `choose_num_splits` decide (split-KV for small decode batches with
    long contexts, judged by block_tables.shape[1] * block_size); 1 forces the single pass,
    > 1 forces split-KV with that many context partitions (any batch, also prefill). window,
    softcap, k_scale, v_scale, sinks: as kernels/ops.py's contract (fp8 caches: the module
    doc; sinks fp32 [num_heads] on query's device)."""
    _check_inputs(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    if num_splits is None:
        num_splits = _auto_num_splits(query, key_cache, block_tables, max_seqlen_q)
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out)
    unused = torch.empty(0, dtype=torch.float32, device=query.device)
    sinks = _sinks_on(query, sinks)
    masking = (window or 0, softcap or 0.0, k_scale, v_scale, sinks)
    if num_splits == 1:
        _launch_attention(*args, (unused, unused, unused), 1, scale, max_seqlen_q, masking)
        return out
    partials = _partials(query, num_splits)
    _launch_attention(*args, partials, num_splits, scale, max_seqlen_q, masking)
    _launch_reduce(out, partials, unused if sinks is None else sinks)
    return out


def _auto_num_splits(query, key_cache, block_tables, max_seqlen_q: int) -> int:
    num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 0
    num_seqs, max_context = block_tables.shape[0], block_tables.shape[1] * key_cache.shape[1]
    return choose_num_splits(num_seqs, key_cache.shape[2], max_seqlen_q, max_context, num_sms)


def _launch_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out, partials,
    num_splits, scale, max_seqlen_q, masking,
):  # fmt: skip
    """The main kernel; with num_splits > 1 it fills partials (out, m, l) instead of out."""
    num_heads, head_dim = query.shape[1:]
    num_seqs, block_size, num_kv_heads = seq_lens.shape[0], key_cache.shape[1], key_cache.shape[2]
    partial_out, partial_m, partial_l = partials
    block_n = 64
    max_context = block_tables.shape[1] * block_size
    partition_size = triton.cdiv(max_context, num_splits * block_n) * block_n
    group_pad, block_q = _tile_sizes(num_heads // num_kv_heads, max_seqlen_q)
    window, softcap, k_scale, v_scale, sinks = masking
    has_sinks = sinks is not None
    if sinks is None:
        sinks = partial_m  # never read (SINKS off)
    if key_cache.dtype not in FP8_DTYPES:  # scales are an fp8 cache's
        k_scale = v_scale = 1.0
    grid = (num_seqs, triton.cdiv(max_seqlen_q, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
        out, partial_out, partial_m, partial_l, sinks,
        scale * LOG2E * k_scale, v_scale, softcap, window, num_splits, partition_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        num_heads * num_splits, num_splits,
        GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        # the interpreter (CPU) multiplies bf16 bit patterns in tl.dot: upcast there only
        DOT_FP32=not query.is_cuda and query.dtype == torch.bfloat16,
        SOFTCAP=softcap > 0, WINDOW=window > 0, WIDEN_KV=key_cache.dtype != query.dtype,
        SINKS=has_sinks and num_splits == 1,  # split-KV: the reducer adds them
        CHUNKED=window < 0,
    )  # fmt: skip


def _launch_reduce(out, partials, sinks):
    """Combine the split-KV partials into out: one program per (token, head); sinks fp32
    [num_heads], or an empty tensor for none."""
    partial_out, partial_m, partial_l = partials
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out, partial_out, partial_m, partial_l, sinks, num_splits,
        out.stride(0), out.stride(1), num_heads * num_splits, num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits), SINKS=sinks.numel() > 0,
    )  # fmt: skip
