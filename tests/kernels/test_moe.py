"""Routed experts: the torch twin against a per-token loop in fp64, the Triton grouped kernel
(TRITON_INTERPRET=1 on CPU) against the twin, awkward shapes included (one token, experts that
get no token, intermediate sizes that are no power of two, top-1 and top-3)."""

import pytest
import torch
from kvpager.kernels.moe import BLOCK_M, fused_moe, sort_pairs_by_expert
from kvpager.kernels.reference import gelu_tanh_and_mul_ref, silu_and_mul_ref
from kvpager.kernels.reference_moe import fused_moe_ref

from tests.kernels.test_paged_attention import TOLERANCES, assert_close


def make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] = -1e9  # expert 0 never chosen: an empty group
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, gate_up, down, weights.to(dtype), ids


def per_token_loop(x, gate_up, down, weights, ids, activation):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = ids[token, slot]
            h = activation(x[token].double() @ gate_up[expert].double().t())
            out[token] += weights[token, slot].double() * (h @ down[expert].double().t())
    return out


SHAPES = [(1, 4, 2, 64, 32), (37, 6, 2, 64, 48), (20, 5, 1, 32, 16), (9, 8, 3, 64, 80)]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), SHAPES)
@pytest.mark.parametrize("activation", [silu_and_mul_ref, gelu_tanh_and_mul_ref])
def test_twin_matches_a_per_token_loop(num_tokens, num_experts, top_k, hidden, inter, activation):
    args = make_moe(num_tokens, num_experts, top_k, hidden, inter, torch.float32)
    out = fused_moe_ref(*args, activation)
    assert out.dtype == torch.float32
    assert_close("twin", out, per_token_loop(*args, activation), torch.float32)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_twin(num_tokens, num_experts, top_k, hidden, inter, dtype):
    args = make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype)
    out = fused_moe(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    atol, rtol = TOLERANCES[dtype]
    expected = fused_moe_ref(*(a.float() if a.is_floating_point() else a for a in args))
    torch.testing.assert_close(out.float(), expected, atol=atol * 4, rtol=rtol * 4)


def test_triton_gelu_and_the_model_activation():
    args = make_moe(13, 4, 2, 64, 32, torch.float32)
    out = fused_moe(*args, gelu_tanh_and_mul_ref)
    assert_close("gelu", out, fused_moe_ref(*args, gelu_tanh_and_mul_ref), torch.float32)


def test_pairs_sorted_by_expert_in_padded_runs():
    ids = torch.tensor([[3, 1], [1, 2], [3, 1]])
    sorted_pairs, block_expert = sort_pairs_by_expert(ids, 4)
    assert block_expert.tolist() == [1, 2, 3]  # expert 0 gets no block
    runs = sorted_pairs.view(3, BLOCK_M)
    assert runs[0, :3].tolist() == [1, 2, 5] and runs[1, :1].tolist() == [3]
    assert runs[2, :2].tolist() == [0, 4]
    assert (runs[0, 3:] == 6).all() and (runs[1, 1:] == 6).all() and (runs[2, 2:] == 6).all()


def test_empty_batch():
    x, gate_up, down, weights, ids = make_moe(1, 4, 2, 32, 16, torch.float32)
    assert fused_moe(x[:0], gate_up, down, weights[:0], ids[:0]).shape == (0, 32)
