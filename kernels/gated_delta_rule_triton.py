"""The gated delta rule in Triton: one launch for a flat batch of prefill chunks and decode
tokens, each sequence reading and writing its own state slot (flash-linear-attention's
fused recurrent form, varlen, with vLLM's state indices).

One program per (sequence, value head, block of BLOCK_V value columns) holds its [K, BLOCK_V]
slice of the state in registers and steps through the sequence's tokens:

    S = exp(g) S;   S = S + k ⊗ beta (v - kᵀ S);   o = qᵀ S

Columns of the state evolve independently, so the value blocks need no communication. Same
signature as kernels/gated_delta_rule_ref.py's gated_delta_rule_varlen_ref, its twin
(tests/kernels/test_gated_delta_rule.py, under TRITON_INTERPRET=1 on CPU).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_g_tok,
    stride_beta_tok,
    stride_out_tok,
    stride_out_head,
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    HEADS_PER_KEY: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq, head, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // HEADS_PER_KEY
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    state_offs = (
        slot * stride_state_slot
        + head * stride_state_head
        + offs_k[:, None] * stride_state_k
        + offs_v[None, :]
    )
    state_mask = mask_k[:, None] & mask_v[None, :]
    h = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        q_offs = t * stride_q_tok + key_head * stride_q_head + offs_k
        q = tl.load(q_ptr + q_offs, mask=mask_k, other=0.0).to(tl.float32)
        k_offs = t * stride_k_tok + key_head * stride_k_head + offs_k
        k = tl.load(k_ptr + k_offs, mask=mask_k, other=0.0).to(tl.float32)
        v_offs = t * stride_v_tok + head * stride_v_head + offs_v
        v = tl.load(v_ptr + v_offs, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_g_tok + head).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_beta_tok + head).to(tl.float32)
        h = h * tl.exp(g)
        delta = (v - tl.sum(h * k[:, None], axis=0)) * beta  # [BLOCK_V]
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        out_offs = t * stride_out_tok + head * stride_out_head + offs_v
        tl.store(out_ptr + out_offs, o, mask=mask_v)
    tl.store(state_ptr + state_offs, h.to(state_ptr.dtype.element_ty), mask=state_mask)


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """q, k [T, Hk, K] (normalised: kernels/gated_delta_rule.py's normalise_qk), v [T, H, V],
    g, beta [T, H]; sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] with state
    states[slots[i]] ([slots, H, K, V] float32, updated in place). Returns o [T, H, V] float32."""
    num_tokens, num_heads, v_dim = v.shape
    num_key_heads, k_dim = k.shape[1:]
    assert num_heads % num_key_heads == 0, "value heads must be a multiple of key heads"
    assert states.is_contiguous(), "the state slots must be contiguous"
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=torch.float32, device=v.device)
    num_seqs = slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_v = min(triton.next_power_of_2(v_dim), 32)
    grid = (num_seqs, num_heads, triton.cdiv(v_dim, block_v))
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, out, states, cu_seqlens, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        HEADS_PER_KEY=num_heads // num_key_heads, K=k_dim, V=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v,
    )  # fmt: skip
    return out
