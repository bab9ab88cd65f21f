"""Latent paged attention (DeepSeek's MLA) in Triton: decode tokens and prefill chunks of a
mixed batch over latent pages, read in place through the block tables.

A latent page row is [latent (L) | rotary key (r)], split in halves over the K and V planes
of a one-head cache ([num_blocks, block_size, 1, (L + r) / 2] each; engine/model/mla.py).
W_UK is absorbed into the query (q_latent = q_nope . W_UK, per head), so every head attends
over the rows themselves, MQA-like, each row read once for a tile of heads:

    score(t, h, s) = [q_latent | q_pe](t, h) . row(s)       (one dot per plane half)
    out(t, h)      = softmax(score * scale) . row[:L]        then . W_UV^T  -> [T, H, v]

The kernel attends over whole rows (value = key = the row) and its launcher keeps the
latent part; the rotary columns it also sums are dropped, a few columns of waste for one
kernel over both planes. Prefill chunks take the same absorbed path (causal mask per query
position), equal to kernels/reference.py's up-projected mla_prefill_ref in exact arithmetic.

Grid: (sequence, query tile, head tile); a tile's rows are BLOCK_Q tokens x BLOCK_H heads:

    row r -> token = q_tile * BLOCK_Q + r // BLOCK_H, head = h_tile * BLOCK_H + r % BLOCK_H

An fp8 cache's planes have their own scales (k_scale, v_scale): folded into the query's
halves for the scores and into the output's halves, so the kernel reads stored values.
The torch twin is kernels/reference_mla.py's mla_paged_attention_ref (same signature).
"""

import torch
import triton
import triton.language as tl
from kvpager.kernels.mla_absorb import absorbed_query, latent_output
from kvpager.kernels.paged_attention_triton import LOG2E, _kv_tile_offsets
from kvpager.kernels.reference import FP8_DTYPES

BLOCK_N = 32  # key positions per tile
ROWS = 16  # rows of a query tile (tl.dot's minimum)


@triton.jit
def _load_halves(ptr, offs, mask, HALF: tl.constexpr):
    """A tile's two halves: columns [0, HALF) and [HALF, 2 * HALF) of rows at offs."""
    first = tl.load(ptr + offs, mask=mask, other=0.0)
    return first, tl.load(ptr + offs + HALF, mask=mask, other=0.0)


@triton.jit
def _mla_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    num_heads,
    stride_cache_block,
    stride_cache_slot,
    stride_block_tables_seq,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq_idx, q_tile, h_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # grid is sized for the longest query chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    token = q_tile * BLOCK_Q + rows // BLOCK_H
    head = h_tile * BLOCK_H + rows % BLOCK_H
    offs_d = tl.arange(0, HALF_PAD)
    row_mask = (token < q_len) & (head < num_heads)
    mask = row_mask[:, None] & (offs_d[None, :] < HALF)
    # query / out rows: [num_tokens, num_heads, 2 * HALF], contiguous
    q_offs = ((q_start + token).to(tl.int64) * num_heads + head)[:, None] * (2 * HALF)
    q_offs += offs_d[None, :]
    q_k, q_v = _load_halves(query_ptr, q_offs, mask, HALF)  # [R, HALF_PAD] each, fp32
    q_pos = seq_len - q_len + token
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    acc_k = tl.zeros([BLOCK_Q * BLOCK_H, HALF_PAD], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_Q * BLOCK_H, HALF_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    table = block_tables_ptr + seq_idx * stride_block_tables_seq
    for start in range(0, kv_end, BLOCK_N):
        kv_offs, kv_mask = _kv_tile_offsets(
            table, 0, start, kv_end, stride_cache_block, stride_cache_slot, 0,
            HALF, HALF_PAD, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q_k, tl.trans(k), input_precision="ieee")
        scores += tl.dot(q_v, tl.trans(v), input_precision="ieee")
        scores *= qk_scale
        pos = start + tl.arange(0, BLOCK_N)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_end)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_k = acc_k * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        acc_v = acc_v * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptr + q_offs, acc_k * inv[:, None], mask=mask)
    tl.store(out_ptr + q_offs + HALF, acc_v * inv[:, None], mask=mask)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """kernels/reference_mla.py's mla_paged_attention_ref on the Triton kernel: q_nope [T, H, n],
    q_pe [T, H, r] (rotated), latent pages [num_blocks, block_size, 1, (L + r) / 2] (K and V
    planes, same strides, last dim contiguous), int32 block_tables [num_seqs, max_blocks],
    cu_seqlens_q [num_seqs + 1], seq_lens [num_seqs]; w_uk [H, n, L], w_uv [H, v, L].
    Returns fp32 [T, H, v]."""
    half = key_cache.shape[-1]
    assert key_cache.shape[2] == 1 and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1 and block_tables.stride(1) == 1
    scales = (k_scale, v_scale) if key_cache.dtype in FP8_DTYPES else (1.0, 1.0)
    query = absorbed_query(q_nope, q_pe, w_uk, half, scales)
    rows = torch.zeros_like(query)  # [T, H, 2 * half]: the attended rows, stored values
    if query.shape[0]:
        _launch(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, rows, scale)
    return latent_output(rows, w_uv, scales)


def _launch(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out, scale):
    num_heads, half = query.shape[1], key_cache.shape[-1]
    block_h = min(ROWS, triton.next_power_of_2(num_heads))
    block_q = ROWS // block_h  # decode and prefill alike: 16 rows a tile
    max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (seq_lens.shape[0], triton.cdiv(max_seqlen_q, block_q), triton.cdiv(num_heads, block_h))
    _mla_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, cu_seqlens_q.int(), seq_lens.int(), out,
        scale * LOG2E, num_heads, key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0), BLOCK_Q=block_q, BLOCK_H=block_h, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), BLOCK_N=BLOCK_N, BLOCK_SIZE=key_cache.shape[1],
    )  # fmt: skip
