"""Qwen3-Next's gated full attention (transformers' Qwen3NextAttention) on the paged cache, as
a piece the decoder selects for the `full_attention` layers of a `qwen3_next` model:

    q_proj     twice as wide as the heads: per head [q (head_dim) | gate (head_dim)]
    q/k norm   per-head RMSNorm with (1 + w) scales, in float32 and rounded once (as Gemma's:
               the loader adds the 1, engine/model/loader.py), before RoPE
    RoPE       on the first rotary_dim = head_dim * partial_rotary_factor channels only
    gate       the attention output times sigmoid(gate), channel by channel, before o_proj

The attention itself is the paged one every family uses (engine/model/attention.py).
"""

import torch
import torch.nn.functional as F
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.kernels.backend import KernelOps
from kvpager.schemas.errors import CheckpointError
from torch import nn


def split_query_gate(
    q_proj_out: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's output [T, heads * 2 * head_dim] -> (q [T, heads, head_dim], gate
    [T, heads * head_dim]): the checkpoint interleaves them head by head."""
    q, gate = q_proj_out.view(-1, num_heads, 2 * head_dim).split(head_dim, dim=-1)
    return q.contiguous(), gate.reshape(q_proj_out.shape[0], -1)


def partial_rotary(
    ops: KernelOps, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first cos.shape[-1] channels of q [T, heads, d] and k [T, kv_heads, d] (the
    rest pass through): the backend's rotate-half kernel on those channels."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return ops.rotary(q, k, cos, sin)
    q_rot, k_rot = ops.rotary(
        q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous(), cos, sin
    )
    return (
        torch.cat([q_rot, q[..., rotary_dim:]], dim=-1),
        torch.cat([k_rot, k[..., rotary_dim:]], dim=-1),
    )


class GatedAttention(nn.Module):
    """One gated full-attention layer: hidden [T, hidden] -> [T, hidden]."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
        dtype: torch.dtype, bias: bool = False, adds_o_bias: bool = True,
    ) -> None:  # fmt: skip
        """`num_heads` / `num_kv_heads`: a tensor-parallel rank's; `adds_o_bias` on one rank
        only (o_proj's output is all-reduced)."""
        super().__init__()
        self.adds_o_bias = adds_o_bias
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = (
            num_heads, num_kv_heads, head_dim, eps,
        )  # fmt: skip

        def param(*shape: int, on: bool = True, dtype: torch.dtype = dtype):
            empty = torch.zeros(*shape, dtype=dtype)
            return nn.Parameter(empty, requires_grad=False) if on else None

        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj, self.q_bias = param(2 * q_size, hidden), param(2 * q_size, on=bias)
        self.k_proj, self.k_bias = param(kv_size, hidden), param(kv_size, on=bias)
        self.v_proj, self.v_bias = param(kv_size, hidden), param(kv_size, on=bias)
        self.o_proj, self.o_bias = param(hidden, q_size), param(hidden, on=bias)
        self.q_norm = param(head_dim, dtype=torch.float32)  # 1 + w
        self.k_norm = param(head_dim, dtype=torch.float32)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor (`self_attn.` stripped): `q_proj.weight`, ..., `q_norm.weight`
        (stored as 1 + w in float32)."""
        module, kind = name.rsplit(".", 1)
        attr = module if kind == "weight" or module.endswith("norm") else f"{module[0]}_bias"
        target = getattr(self, attr, None)
        if target is None or target.shape != tensor.shape:
            shape = None if target is None else tuple(target.shape)
            got = tuple(tensor.shape)
            raise CheckpointError(f"self_attn.{name}: shape {got}, expected {shape}")
        if module.endswith("norm"):
            tensor = tensor.float() + 1.0
        target.data.copy_(tensor)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PagedAttention,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """h [T, hidden]; cos, sin [T, rotary_dim] the tokens' rows of the RoPE tables."""
        num_tokens, d = h.shape[0], self.head_dim
        q, gate = split_query_gate(F.linear(h, self.q_proj, self.q_bias), self.num_heads, d)
        k = F.linear(h, self.k_proj, self.k_bias).view(num_tokens, self.num_kv_heads, d)
        v = F.linear(h, self.v_proj, self.v_bias).view(num_tokens, self.num_kv_heads, d)
        q, k = self._head_norm(ops, q, self.q_norm), self._head_norm(ops, k, self.k_norm)
        q, k = partial_rotary(ops, q, k, cos, sin)
        attn = attention(q, k, v, layer_cache, meta).reshape(num_tokens, -1)
        o_bias = self.o_bias if self.adds_o_bias else None
        return F.linear(attn * torch.sigmoid(gate), self.o_proj, o_bias)

    def _head_norm(self, ops: KernelOps, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.head_dim)
        return ops.add_rms_norm(rows, None, weight, self.eps)[0].view(x.shape)
