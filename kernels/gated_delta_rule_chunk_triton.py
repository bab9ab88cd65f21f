"""The gated delta rule's chunked prefill form in Triton (the WY / UT transform, as
flash-linear-attention's `chunk_gated_delta_rule`), over state slots: a flat batch of prefill
chunks, each sequence from its own slot. Decode tokens stay on the token-by-token kernel
(kernels/gated_delta_rule_triton.py), which one matmul-free step suits.

One program per (sequence, value head, block of BLOCK_V value columns) holds its [K, BLOCK_V]
slice of the state in registers and walks the sequence CHUNK tokens at a time. Per chunk, as
the torch form (kernels/gated_delta_rule.py's `_chunk`) computes it:

    decay[l, s] = exp(cum[l] - cum[s]) for s <= l (cum: the running sum of g), else 0
    T = (I + strict lower part of (beta k kᵀ ∘ decay))⁻¹    (forward substitution, a row a step)
    v_new = T (beta v - (beta exp(cum) k) S)
    o = (exp(cum) q) S + (q kᵀ ∘ decay) v_new;   S = exp(cum[-1]) S + (exp(cum[-1] - cum) k)ᵀ v_new

Columns of the state evolve independently, so the value blocks need no communication (each
recomputes T, which depends on k, g and beta only). Padding rows past a sequence's end load
g = beta = 0 and k = v = 0: they neither decay nor write. Twin: gated_delta_rule_varlen_ref
(tests/kernels/test_gated_delta_rule_chunk.py, TRITON_INTERPRET=1 on CPU, and sm_90 compile).
"""

import torch
import triton
import triton.language as tl
from kvpager.kernels.mamba2_triton import state_tile

# Tokens a chunk: the chunk's tiles, T and the [K, BLOCK_V] state share the registers; at
# Qwen3-Next's 128 x 128 heads, 64-token chunks compiled for sm_90 with twice the spills
# (ptxas: 18 KB of stack against 8 KB) and 13 times the compile time. Not tuned on a device.
CHUNK_SIZE = 32


@triton.jit
def _unit_lower_inverse(system, offs_l, CHUNK: tl.constexpr):
    """(I + strict lower part of `system` [L, L])⁻¹ by forward substitution: row i of the
    inverse is e_i minus system's row i (left of the diagonal) times the rows above it."""
    eye = (offs_l[:, None] == offs_l[None, :]).to(tl.float32)
    strict = tl.where(offs_l[:, None] > offs_l[None, :], system, 0.0)
    inverse = eye
    for i in range(1, CHUNK):
        at_i = offs_l[:, None] == i
        row = tl.sum(tl.where(at_i, strict, 0.0), 0)  # [L]: system[i, j] for j < i
        # e_i minus the corrections for the earlier writes of the chunk
        new_row = (offs_l == i).to(tl.float32) - tl.sum(row[:, None] * inverse, 0)
        inverse = tl.where(at_i, new_row[None, :], inverse)
    return inverse


@triton.jit
def _chunk_gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, cu_seqlens_ptr, slots_ptr,
    seq_ids_ptr, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok,
    stride_v_head, stride_g_tok, stride_beta_tok, stride_out_tok, stride_out_head,
    stride_state_slot, stride_state_head, stride_state_k,
    HEADS_PER_KEY: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq = tl.load(seq_ids_ptr + tl.program_id(0)).to(tl.int64)
    head, pid_v = tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // HEADS_PER_KEY
    offs_l = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    states, state_mask = state_tile(
        state_ptr, slot, head, offs_k, offs_v, K, V, stride_state_slot, stride_state_head,
        stride_state_k,
    )  # fmt: skip
    h = tl.load(states, mask=state_mask, other=0.0).to(tl.float32)  # [BK, BV]
    causal = offs_l[:, None] >= offs_l[None, :]
    for chunk_start in range(start, end, CHUNK):
        rows = chunk_start + offs_l
        mask_l = rows < end
        qk_mask = mask_l[:, None] & mask_k[None, :]
        q_offs = rows[:, None] * stride_q_tok + key_head * stride_q_head + offs_k[None, :]
        q = tl.load(q_ptr + q_offs, mask=qk_mask, other=0.0).to(tl.float32)  # [L, BK]
        k_offs = rows[:, None] * stride_k_tok + key_head * stride_k_head + offs_k[None, :]
        k = tl.load(k_ptr + k_offs, mask=qk_mask, other=0.0).to(tl.float32)
        v_offs = rows[:, None] * stride_v_tok + head * stride_v_head + offs_v[None, :]
        v_mask = mask_l[:, None] & mask_v[None, :]
        v = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0).to(tl.float32)  # [L, BV]
        g = tl.load(g_ptr + rows * stride_g_tok + head, mask=mask_l, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_beta_tok + head, mask=mask_l, other=0.0)
        beta = beta.to(tl.float32)
        cum = tl.cumsum(g, 0)  # [L]: log of the decay from the chunk's start
        total = tl.sum(g, 0)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        k_beta = k * beta[:, None]
        system = tl.dot(k_beta, tl.trans(k), input_precision="ieee") * decay
        inverse = _unit_lower_inverse(system, offs_l, CHUNK)
        k_decayed = k_beta * tl.exp(cum)[:, None]
        u = v * beta[:, None] - tl.dot(k_decayed, h, input_precision="ieee")
        v_new = tl.dot(inverse, u, input_precision="ieee")  # [L, BV]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.dot(q * tl.exp(cum)[:, None], h, input_precision="ieee")
        o += tl.dot(scores, v_new, input_precision="ieee")
        out_offs = rows[:, None] * stride_out_tok + head * stride_out_head + offs_v[None, :]
        tl.store(out_ptr + out_offs, o, mask=v_mask)
        k_to_end = k * tl.exp(total - cum)[:, None]
        h = h * tl.exp(total) + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
    tl.store(states, h.to(state_ptr.dtype.element_ty), mask=state_mask)


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """gated_delta_rule_varlen's contract (q, k [T, Hk, K] normalised, v [T, H, V], g, beta
    [T, H]; sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] on states[slots[i]], updated
    in place) in the chunked form, for the sequences `seq_ids` (all: None). Returns
    o [T, H, V] float32; rows of sequences not run are left unset."""
    num_tokens, num_heads, v_dim = v.shape
    num_key_heads, k_dim = k.shape[1:]
    assert num_heads % num_key_heads == 0, "value heads must be a multiple of key heads"
    assert states.is_contiguous(), "the state slots must be contiguous"
    assert states.shape[1:] == (num_heads, k_dim, v_dim), "state shape"
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if seq_ids is None:
        seq_ids = torch.arange(slots.shape[0], device=v.device)
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=torch.float32, device=v.device)
    if num_tokens == 0 or seq_ids.shape[0] == 0:
        return out
    block_v = max(16, min(triton.next_power_of_2(v_dim), 32))
    grid = (seq_ids.shape[0], num_heads, triton.cdiv(v_dim, block_v))
    _chunk_gated_delta_rule_kernel[grid](
        q, k, v, g, beta, out, states, cu_seqlens, slots, seq_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        HEADS_PER_KEY=num_heads // num_key_heads, K=k_dim, V=v_dim,
        CHUNK=max(16, triton.next_power_of_2(chunk_size)),
        BLOCK_K=max(16, triton.next_power_of_2(k_dim)), BLOCK_V=block_v,
    )  # fmt: skip
    return out
