"""Qwen3-Next's gated full attention on the paged cache equals transformers'
Qwen3NextAttention (and Qwen3.5's) in fp32 (output gate, partial rotary, (1 + w) q/k norms,
GQA): over a whole prompt, and over the same prompt prefilled in chunks and then decoded token
by token through the cache's block table (blocks out of order)."""

import pytest
import torch
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.engine.model.qwen3_next.gated_attention import GatedAttention
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 2, 16, 4
BLOCK_TABLE = [3, 0, 5, 1, 4, 2]


def hf_parts(seed: int, factor: float, qwen3_5: bool = False):
    config = Qwen3NextConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=1, layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                         "partial_rotary_factor": factor},
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    if qwen3_5:  # Qwen3.5's attention is the same layer (its text RoPE aside)
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention as cls
    else:
        cls = Qwen3NextAttention
    layer = cls(config, 0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer, Qwen3NextRotaryEmbedding(config)


def ours(layer: Qwen3NextAttention) -> GatedAttention:
    attention = GatedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 1e-6, torch.float32)
    for name, tensor in layer.state_dict().items():
        attention.load_tensor(name, tensor)
    return attention


def reference(layer, rotary, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        cos, sin = rotary(prompt[None], torch.arange(prompt.shape[0])[None])
        return layer(prompt[None], (cos, sin), None)[0][0]


def meta_for(start: int, end: int) -> AttentionMetadata:
    positions = torch.arange(start, end)
    blocks = torch.tensor(BLOCK_TABLE)[positions // BLOCK]
    return AttentionMetadata(
        slot_mapping=blocks * BLOCK + positions % BLOCK,
        block_tables=torch.tensor([BLOCK_TABLE], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        max_seqlen_q=end - start,
    )


CHUNKED_THEN_DECODE = [(0, 5), (5, 9), *((i, i + 1) for i in range(9, 13))]


@pytest.mark.parametrize("factor", [0.25, 1.0])
@pytest.mark.parametrize("pieces", [[(0, 13)], CHUNKED_THEN_DECODE])
@pytest.mark.parametrize("qwen3_5", [False, True])
def test_equals_transformers(factor, pieces, qwen3_5):
    layer, rotary = hf_parts(seed=int(factor * 4), factor=factor, qwen3_5=qwen3_5)
    prompt = torch.randn(13, HIDDEN)
    expected = reference(layer, rotary, prompt)
    ops = get_kernel_ops("torch")
    attention = ours(layer)
    paged = PagedAttention(ops, HEAD_DIM**-0.5)
    cache = torch.zeros(2, len(BLOCK_TABLE), BLOCK, KV_HEADS, HEAD_DIM)
    cos, sin = rotary(prompt[None], torch.arange(13)[None])
    assert cos.shape[-1] == int(HEAD_DIM * factor)
    outputs = []
    for start, end in pieces:
        rows = slice(start, end)
        outputs.append(attention(prompt[rows], cos[0, rows], sin[0, rows], paged, cache,
                                 meta_for(start, end), ops))  # fmt: skip
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-4, atol=1e-4)


def test_a_wrong_shape_is_refused():
    attention = GatedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, 1e-6, torch.float32)
    with pytest.raises(CheckpointError, match="q_proj.weight"):
        attention.load_tensor("q_proj.weight", torch.zeros(HEADS * HEAD_DIM, HIDDEN))
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        attention.load_tensor("q_proj.bias", torch.zeros(2 * HEADS * HEAD_DIM))
