"""Qwen3-Next's sparse MoE block (routed experts plus a sigmoid-gated shared expert) equals
transformers' Qwen3NextSparseMoeBlock in fp32, renormalised over the top k or not, and
Qwen3.5-MoE's block."""

import pytest
import torch
from kvpager.engine.model.qwen3_next.shared_expert_moe import SharedExpertMoe
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

HIDDEN = 16


def hf_config(norm_topk_prob: bool) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        hidden_size=HIDDEN, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, norm_topk_prob=norm_topk_prob, num_hidden_layers=1,
        layer_types=["full_attention"],
    )  # fmt: skip


def expert_config(config: Qwen3NextConfig) -> ModelConfig:
    """The routed experts' fields: Qwen3-Next routes as Qwen3-MoE does (its full rotary
    parameters here only because ModelConfig does not take qwen3_next's partial one yet)."""
    rope = {"rope_type": "default", "rope_theta": 1e4}
    return ModelConfig.from_dict(
        {**config.to_dict(), "model_type": "qwen3_moe", "rope_parameters": rope}
    )


def compare(block, config: Qwen3NextConfig) -> tuple[SharedExpertMoe, torch.Tensor, torch.Tensor]:
    """(ours, h, its output) after checking it equals `block` (weights drawn at random)."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    moe = SharedExpertMoe(expert_config(config), 20, torch.float32)
    for name, tensor in block.state_dict().items():
        moe.load_tensor(name, tensor)
    h = torch.randn(9, HIDDEN)
    with torch.no_grad():
        expected = block.float().eval()(h[None])[0]
    out = moe(h, get_kernel_ops("torch"))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    return moe, h, out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equals_transformers(norm_topk_prob):
    config = hf_config(norm_topk_prob)
    torch.manual_seed(int(norm_topk_prob))
    moe, h, out = compare(Qwen3NextSparseMoeBlock(config), config)
    ops = get_kernel_ops("torch")
    routed = moe.experts(h, ops.fused_moe, ops.silu_and_mul)
    assert (out - routed).abs().max() > 1e-2  # the gated shared expert counts


def test_qwen3_5_moe_block_equals_transformers():
    """Qwen3.5-MoE's block is the same, always renormalised over the top k."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    fields = dict(hidden_size=HIDDEN, num_experts=6, num_experts_per_tok=3,
                  moe_intermediate_size=12, shared_expert_intermediate_size=20)  # fmt: skip
    torch.manual_seed(7)
    config = hf_config(norm_topk_prob=True)
    config.num_experts_per_tok = 3
    compare(Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**fields)), config)


def test_a_wrong_name_or_shape_is_refused():
    moe = SharedExpertMoe(expert_config(hf_config(True)), 20, torch.float32)
    with pytest.raises(CheckpointError, match="shared_expert_gate"):
        moe.load_tensor("shared_expert_gate.weight", torch.zeros(2, HIDDEN))
    with pytest.raises(CheckpointError, match="expected None"):
        moe.load_tensor("experts.w1", torch.zeros(2))
