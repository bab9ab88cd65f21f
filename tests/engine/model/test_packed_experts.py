"""Routed experts on oneDNN-packed matmuls (engine/model/packed_experts.py) against the torch
twin `fused_moe_ref` on the same random weights: top-1 and top-2, 1 and 37 tokens, an expert
no token picks, both activations; fp32 tightly, bf16 where the CPU runs it natively. The
decoder packs bf16 experts only (fp32 measured slower), the rank's slices under TP."""

import pytest
import torch
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.moe import RoutedExperts
from kvpager.engine.model.packed_experts import PackedExperts
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels import cpu_layer_ops
from kvpager.kernels.reference import gelu_tanh_and_mul_ref
from kvpager.kernels.reference_moe import fused_moe_ref

NUM_EXPERTS, HIDDEN, INTER = 6, 64, 48
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16: not packed"),
)


def make_experts(num_tokens: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    """Weights, hidden states and a routing in which expert 0 gets no token."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    logits[:, 0] = -1e9
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return hidden, gate_up, down, weights.to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("activation", [cpu_layer_ops.silu_and_mul, gelu_tanh_and_mul_ref])
def test_packed_experts_match_the_twin(dtype, num_tokens, top_k, activation):
    hidden, gate_up, down, weights, ids = make_experts(num_tokens, top_k, dtype)
    assert not (ids == 0).any()
    packed = PackedExperts.pack(gate_up, down)
    assert packed is not None
    out = packed(hidden, weights, ids, activation)
    expected = fused_moe_ref(hidden, gate_up, down, weights, ids, activation)
    assert out.dtype == dtype and out.shape == hidden.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_no_tokens_give_an_empty_output():
    hidden, gate_up, down, weights, ids = make_experts(3, 2, torch.float32)
    out = PackedExperts.pack(gate_up, down)(hidden[:0], weights[:0], ids[:0], gelu_tanh_and_mul_ref)
    assert out.shape == (0, HIDDEN)


def test_float16_is_not_packed():
    _, gate_up, down, _, _ = make_experts(1, 1, torch.float16)
    assert PackedExperts.pack(gate_up, down) is None


def tiny_experts(dtype: torch.dtype) -> RoutedExperts:
    """A Qwen3-MoE layer's experts as rank 0 of 2 holds them: half of each intermediate."""
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 32,
            "hidden_size": HIDDEN,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": INTER,
        }
    )
    experts = RoutedExperts(config, INTER // 2, dtype)
    gen = torch.Generator().manual_seed(1)
    for param in experts.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return experts


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16: experts not packed")
def test_bf16_experts_pack_the_rank_slices_once_and_release_the_plain_stacks():
    experts = tiny_experts(torch.bfloat16)
    hidden = torch.randn(5, HIDDEN).to(torch.bfloat16)
    unpacked = experts(hidden, fused_moe_ref, gelu_tanh_and_mul_ref)
    experts.build_matmuls(pack=False)
    assert not experts.is_packed
    experts.build_matmuls(pack=True)
    assert experts.is_packed and experts.packed.intermediate == INTER // 2
    assert len(experts.packed.gate_up) == len(experts.packed.down) == NUM_EXPERTS
    assert experts.gate_up.numel() == 0 and experts.down.numel() == 0
    out = experts(hidden, fused_moe_ref, gelu_tanh_and_mul_ref)  # the twin would fail: released
    torch.testing.assert_close(out.float(), unpacked.float(), rtol=2e-2, atol=2e-2)


def test_float32_experts_stay_on_the_twin():
    """Packing float32 experts measured slower (packed_experts.PACKED_DTYPES)."""
    experts = tiny_experts(torch.float32)
    experts.build_matmuls(pack=True)
    assert not experts.is_packed
    assert tuple(experts.gate_up.shape) == (NUM_EXPERTS, INTER, HIDDEN)
