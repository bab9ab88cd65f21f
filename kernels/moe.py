"""Routed experts on CUDA: a grouped matmul kernel, launched twice (gate_up, then down).

The (token, slot) pairs of a batch are sorted by expert and each expert's run padded to a
multiple of BLOCK_M, so every row block belongs to one expert (vLLM's fused_moe layout, kept
simple: the activation runs between the two launches, the top-k sum after them):

    pair p = token * top_k + slot        sorted_pairs[i]: the pair in sorted row i (padding:
                                         num_pairs, masked), block_expert[i // BLOCK_M]: its
                                         expert
    launch 1  inter[p] = hidden[p // top_k] @ gate_up[e].T          [num_pairs, 2 * I]
    launch 2  rows[p]  = act(inter)[p] @ down[e].T * weight[p]      [num_pairs, H]
    out[t]    = sum over slots of rows[t * top_k + slot]

Same signature as kernels/reference_moe.py's fused_moe_ref, its twin.
"""

import torch
import triton
import triton.language as tl
from kvpager.kernels.reference import silu_and_mul_ref

BLOCK_M = 16


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_a_row,
    stride_b_expert,
    stride_b_n,
    stride_c_row,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[pair] = a[pair // A_ROW_DIV] @ b[expert].T (times weights[pair]) for one row block
    of one expert and BLOCK_N output columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = pairs // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        a_mask = valid[:, None] & (offs_k[None, :] < K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a_row + offs_k[None, :], mask=a_mask, other=0.0
        )
        b_offs = expert * stride_b_expert + offs_n[None, :] * stride_b_n + offs_k[:, None]
        b_mask = (offs_n[None, :] < N) & (offs_k[:, None] < K)
        b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_offs = pairs[:, None] * stride_c_row + offs_n[None, :]
    c_mask = valid[:, None] & (offs_n[None, :] < N)
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def sort_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int64 [padded rows], block_expert int32 [padded rows / BLOCK_M]): each
    expert's pairs in a run padded to BLOCK_M with the sentinel num_pairs."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_starts = torch.cumsum(padded, 0) - padded
    sorted_starts = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - sorted_starts[experts]
    total = int(padded.sum())
    sorted_pairs = torch.full((total,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[padded_starts[experts] + rank_in_expert] = order
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // BLOCK_M
    )
    return sorted_pairs, block_expert.to(torch.int32)


def _grouped_matmul(a, b, out, sorted_pairs, block_expert, weights, a_row_div) -> None:
    """out[pair] = a[pair // a_row_div] @ b[expert].T (* weights[pair] when given)."""
    num_pairs, (n, k) = out.shape[0], b.shape[1:]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, b, out, sorted_pairs, block_expert, out if weights is None else weights,
        num_pairs, n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        # the interpreter (CPU) multiplies bf16 bit patterns in tl.dot: upcast there only
        DOT_FP32=not a.is_cuda and a.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation=silu_and_mul_ref,
) -> torch.Tensor:
    """Routed experts. hidden [T, H] rows contiguous; gate_up [E, 2 * I, H] and down [E, H, I]
    contiguous; topk_weights [T, k]; topk_ids int [T, k]. Returns [T, H] in hidden's dtype."""
    assert hidden.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    sorted_pairs, block_expert = sort_pairs_by_expert(topk_ids, gate_up.shape[0])
    inter = hidden.new_empty((num_pairs, gate_up.shape[1]))
    _grouped_matmul(hidden, gate_up, inter, sorted_pairs, block_expert, None, top_k)
    act = activation(inter).contiguous()  # [num_pairs, I]
    rows = hidden.new_empty((num_pairs, down.shape[1]))
    weights = topk_weights.to(hidden.dtype).flatten().contiguous()
    _grouped_matmul(act, down, rows, sorted_pairs, block_expert, weights, 1)
    return rows.view(num_tokens, top_k, -1).sum(dim=1)
