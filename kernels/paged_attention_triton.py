"""Paged attention's Triton kernels: one kernel for mixed batches of prefill chunks and decode
tokens (launched by kernels/paged_attention.py).

Each program owns one query tile of one sequence and one KV head. With GQA the GROUP query
heads sharing that KV head are stacked into the tile's rows, so K/V are read once for all of
them (rows padded to a power of 2 and masked when GROUP is not one):

    row r of the tile -> token  = q_tile * BLOCK_Q + r // GROUP_PAD   (within the sequence)
                         head   = kv_head * GROUP  + r %  GROUP_PAD
                         q_pos  = seq_len - q_len + token              (causal position)
    key position pos  -> block  = block_table[pos // BLOCK_SIZE]
                         cache[block, pos % BLOCK_SIZE, kv_head, :]

The key tile (BLOCK_N positions) is gathered through the block table position by position, so
BLOCK_N is independent of the cache block size. A sliding window (WINDOW > 0 keys: query at
q_pos sees q_pos - WINDOW < pos <= q_pos) starts the tile's key loop at its first query's
window and masks per row; chunked local attention (CHUNKED: C = -window, query at q_pos sees
C * (q_pos // C) <= pos <= q_pos) alike from its first query's chunk; soft-capping (SOFTCAP > 0)
squashes each score with tanh first.
Split-KV (flash-decoding) runs the same kernel with the context cut into `num_splits`
partitions along grid axis 2: each program writes its unnormalised partial output with its
running max and sum, and `_reduce_splits_kernel` combines them. Attention sinks (SINKS: a
logit per query head, gpt-oss's) join the softmax once, where its sum is final: after the key
loop in a single pass, in the reducer under split-KV; they add to the sum and nothing to the
output (`_add_sink`).

An fp8 cache (float8_e4m3fn / float8_e5m2) is widened to the query's dtype as each tile is
loaded (exact: both formats fit in bf16 and fp16); its scales are linear, so k_scale joins
the softmax scale and v_scale multiplies the output (each split's partial alike).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# the same inside kernels: compiled Triton reads only constexpr globals (the interpreter reads
# any, so the tests on CPU did not see the soft-cap path fail to compile for CUDA)
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)


@triton.jit
def _kv_tile_offsets(
    block_table_ptr,
    kv_head,
    start,
    kv_end,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Cache offsets and mask, [BLOCK_N, HEAD_DIM_PAD], of positions start.. (K and V alike)."""
    pos = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_range = pos < kv_end
    block_id = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    row = block_id * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
    row += kv_head * stride_cache_head
    return row[:, None] + offs_d[None, :], in_range[:, None] & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _attend_range(
    q,
    q_pos,
    kv_start,
    kv_end,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    kv_head,
    qk_scale,
    softcap,
    window,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    WIDEN_KV: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """Online softmax of q [BLOCK_M, HEAD_DIM_PAD] over keys kv_start..kv_end (causal, and
    within `window` keys of each row's position when WINDOW, inside its chunk of -window keys
    when CHUNKED).

    Returns the unnormalised fp32 output, the running max (log2 domain) and the running sum.
    Rows that see no key keep max -1e30 and sum 0 (finite, so no NaN reaches the reducer).
    """
    acc = tl.zeros([q.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], -1e30, dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        kv_offs, kv_mask = _kv_tile_offsets(
            block_table_ptr, kv_head, start, kv_end, stride_cache_block, stride_cache_slot,
            stride_cache_head, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, BLOCK_SIZE,
        )  # fmt: skip
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_FP32 or WIDEN_KV:  # to q's dtype: fp32 under DOT_FP32, else the model's
            k, v = k.to(q.dtype), v.to(q.dtype)
        # "ieee" only matters for fp32 caches (no tf32); bf16/fp16 use tensor cores anyway
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFTCAP:  # qk_scale is scale * log2(e): cap in natural units, back to log2's
            capped = scores / (LOG2E_IN_KERNEL * softcap)
            # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for any x
            scores = softcap * LOG2E_IN_KERNEL * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))
        pos = start + tl.arange(0, BLOCK_N)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_end)
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if CHUNKED:
            visible = visible & (pos[None, :] >= q_pos[:, None] - q_pos[:, None] % -window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _add_sink(acc, m_i, l_i, sink):
    """The running softmax (acc, max and sum in the log2 domain) with a sink logit per row
    (natural units, fp32) joined: it raises the max and the sum, never the output."""
    sink = sink * LOG2E_IN_KERNEL
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.exp2(sink - m_new)


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_m_ptr,
    partial_l_ptr,
    sinks_ptr,
    qk_scale,
    v_scale,
    softcap,
    window,
    num_splits,
    partition_size,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_tables_seq,
    stride_partial_token,
    stride_partial_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    WIDEN_KV: tl.constexpr,
    SINKS: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    seq_idx, q_tile = tl.program_id(0), tl.program_id(1)
    kv_head, split_idx = tl.program_id(2) // num_splits, tl.program_id(2) % num_splits
    q_start = tl.load(cu_seqlens_q_ptr + seq_idx)
    q_len = tl.load(cu_seqlens_q_ptr + seq_idx + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # grid is sized for the longest query chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (token < q_len) & (rows % GROUP_PAD < GROUP)
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    token_idx = (q_start + token).to(tl.int64)  # row in the packed batch
    q_offs = token_idx[:, None] * stride_query_token + head[:, None] * stride_query_head
    q = tl.load(query_ptr + q_offs + offs_d[None, :], mask=mask, other=0.0)
    # causal: the tile's last query sits at seq_len - q_len + (q_tile + 1) * BLOCK_Q - 1
    kv_start = 0
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    if SPLIT:
        kv_start = split_idx * partition_size
        kv_end = tl.minimum(kv_end, kv_start + partition_size)
    if WINDOW:  # nothing left of the tile's first query's window (a split may hold none)
        kv_start = tl.maximum(kv_start, seq_len - q_len + q_tile * BLOCK_Q - window + 1)
    if CHUNKED:  # nothing before the tile's first query's chunk
        first_q = seq_len - q_len + q_tile * BLOCK_Q
        kv_start = tl.maximum(kv_start, first_q - first_q % -window)
    acc, m_i, l_i = _attend_range(
        q, seq_len - q_len + token, kv_start, kv_end, key_cache_ptr, value_cache_ptr,
        block_tables_ptr + seq_idx * stride_block_tables_seq, kv_head, qk_scale, softcap, window,
        stride_cache_block, stride_cache_slot, stride_cache_head,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, BLOCK_SIZE, DOT_FP32, SOFTCAP, WINDOW, WIDEN_KV,
        CHUNKED,
    )  # fmt: skip
    if WIDEN_KV:
        acc = acc * v_scale
    if SPLIT:
        # partials: [num_tokens, num_heads, num_splits] (+ [head_dim] for the output)
        part = token_idx * stride_partial_token + head * stride_partial_head + split_idx
        tl.store(partial_m_ptr + part, m_i, mask=row_mask)
        tl.store(partial_l_ptr + part, l_i, mask=row_mask)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
    else:
        if SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32)
            acc, m_i, l_i = _add_sink(acc, m_i, l_i, sink)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = token_idx[:, None] * stride_out_token + head[:, None] * stride_out_head
        out_ptrs = out_ptr + out_offs + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_m_ptr,
    partial_l_ptr,
    sinks_ptr,
    num_splits,
    stride_out_token,
    stride_out_head,
    stride_partial_token,
    stride_partial_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    token_idx, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = token_idx * stride_partial_token + head * stride_partial_head + offs_s
    split_mask = offs_s < num_splits
    m = tl.load(partial_m_ptr + part, mask=split_mask, other=float("-inf"))
    l_i = tl.load(partial_l_ptr + part, mask=split_mask, other=0.0)
    top = tl.max(m, 0)
    if SINKS:  # the sink joins the global max and the sum once, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_IN_KERNEL
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # rescale every split to the global max
    denom = tl.sum(weight * l_i, 0)
    if SINKS:
        denom += tl.exp2(sink - top)
    mask = split_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    out_ptrs = out_ptr + token_idx * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
