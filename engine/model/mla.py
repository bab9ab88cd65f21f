"""DeepSeek's multi-head latent attention on latent pages (engine/deepseek_family.py).

Per token the cache holds one row, the normalised latent (`kv_lora_rank`) and the rotated key
shared by every head (`qk_rope_head_dim`), split in halves over the K and V planes of a
one-head cache (ModelConfig.cache_head_dim); nothing per head. kv_b_proj's rows are W_UK
(each head's key without RoPE) and W_UV (its value): a prefill chunk up-projects the
context's latents to per-head keys and values, a decode token absorbs W_UK into its query and
W_UV after attention, attending over the latents (kernels/reference_mla.py: mla_paged_attention_ref,
the torch twin; the backend's `mla_attention`: C on the cpu set, Triton on the triton set).

RoPE on adjacent pairs (`rope_interleave`) is turned into rotate-half by reordering the rotary
rows of q and of kv_a_proj_with_mqa at load (`rope_row_order`); q . k is unchanged.

Under tensor parallelism the heads split over the ranks: each holds its heads' rows of
q_b_proj (q_proj) and kv_b_proj and their columns of o_proj (all-reduced by the decoder);
q_a_proj, kv_a_proj_with_mqa and their norms are every head's, so every rank computes the
whole latent and keeps whole latent pages.
"""

from collections.abc import Callable

import torch
from kvpager.engine.model.linear import make_linear
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import KernelOps
from kvpager.kernels.reference import reshape_and_cache_ref
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rope_row_order(
    block: int, rope_dim: int, interleaved: bool
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Reorders rows in blocks of `block` whose last `rope_dim` rows are rotary: evens, then
    odds (adjacent pairs -> halves); None when the checkpoint rotates halves already."""
    if not interleaved:
        return None
    rope = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    order = torch.cat((torch.arange(block - rope_dim), block - rope_dim + rope))

    def reorder(tensor: torch.Tensor) -> torch.Tensor:
        blocks = tensor.reshape(-1, block, *tensor.shape[1:])
        return blocks[:, order].reshape(tensor.shape)

    return reorder


class MlaAttention(nn.Module):
    """One layer's latent attention: h [T, hidden] in, o_proj's output [T, hidden] out."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, norm_dtype: torch.dtype, shard: Shard
    ) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, shard.num_heads  # this rank's heads
        self.heads, self.eps, self.shard = heads, config.rms_norm_eps, shard
        self.nope, self.rope, self.v_dim = (
            config.qk_nope_head_dim,
            config.head_dim,
            config.v_head_dim,
        )
        self.latent_rank, self.q_rank = config.kv_lora_rank, config.q_lora_rank
        self.interleaved = config.rope_interleaved
        q_rows = heads * (self.nope + self.rope)
        self.q_a = self.q_a_norm = None
        if self.q_rank:
            self.q_a = _param(self.q_rank, hidden, dtype=dtype)
            self.q_a_norm = _param(self.q_rank, dtype=norm_dtype)
        self.q_b = _param(q_rows, self.q_rank or hidden, dtype=dtype)  # q_proj without q_a
        self.kv_a = _param(self.latent_rank + self.rope, hidden, dtype=dtype)
        self.kv_a_norm = _param(self.latent_rank, dtype=norm_dtype)
        self.kv_b = _param(heads * (self.nope + self.v_dim), self.latent_rank, dtype=dtype)
        # attention_bias: q_a_proj's and kv_a_proj_with_mqa's (o_proj's is the decoder's o_bias)
        biased = config.attention_bias
        self.q_a_bias = _param(self.q_rank, dtype=dtype) if biased and self.q_rank else None
        self.kv_a_bias = _param(self.latent_rank + self.rope, dtype=dtype) if biased else None
        self.o = _param(hidden, heads * self.v_dim, dtype=dtype)

    def checkpoint_params(self) -> dict[str, tuple[nn.Parameter, object, object]]:
        """transformers' names (after `self_attn.`) -> (parameter, row transform or None,
        the rank's part of the checkpoint tensor: sharding.Part, None for all of it)."""
        interleaved, heads_of = self.interleaved, self.shard.rows_of_heads
        q_order = rope_row_order(self.nope + self.rope, self.rope, interleaved)
        kv_order = rope_row_order(self.latent_rank + self.rope, self.rope, interleaved)
        q_b = (self.q_b, q_order, heads_of(0, self.nope + self.rope))
        params = {
            "kv_a_proj_with_mqa.weight": (self.kv_a, kv_order, None),
            "kv_a_layernorm.weight": (self.kv_a_norm, None, None),
            "kv_b_proj.weight": (self.kv_b, None, heads_of(0, self.nope + self.v_dim)),
            "o_proj.weight": (self.o, None, heads_of(1, self.v_dim)),
        }
        if self.kv_a_bias is not None:
            params["kv_a_proj_with_mqa.bias"] = (self.kv_a_bias, kv_order, None)
        if self.q_a_bias is not None:
            params["q_a_proj.bias"] = (self.q_a_bias, None, None)
        if self.q_a is None:
            return {**params, "q_proj.weight": q_b}
        return {
            **params,
            "q_a_proj.weight": (self.q_a, None, None),
            "q_a_layernorm.weight": (self.q_a_norm, None, None),
            "q_b_proj.weight": q_b,
        }

    def build_matmuls(self, pack: bool) -> None:
        """The projections' matmuls; the plain weights stay (kv_b's rows are W_UK / W_UV)."""
        q_a = make_linear(self.q_a, self.q_a_bias, False)[0] if self.q_a is not None else None
        self.q_a_proj = q_a
        self.q_b_proj = make_linear(self.q_b, None, False)[0]
        self.kv_a_proj = make_linear(self.kv_a, self.kv_a_bias, False)[0]
        self.o_proj = make_linear(self.o, None, False)[0]

    def forward(
        self,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        meta,
        ops: KernelOps,
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """h [T, hidden] (the normed input), the tokens' (cos, sin) rows, the layer's cache
        [2, blocks, block_size, 1, cache_head_dim]; kv_scales: an fp8 cache's (k, v). Under
        tensor parallelism the output is this rank's heads' share (the caller all-reduces)."""
        num_tokens = h.shape[0]
        if self.q_a_proj is not None:
            h_q = ops.add_rms_norm(self.q_a_proj(h), None, self.q_a_norm, self.eps)[0]
        else:
            h_q = h
        q = self.q_b_proj(h_q).view(num_tokens, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj(h).split([self.latent_rank, self.rope], dim=-1)
        latent = ops.add_rms_norm(latent.contiguous(), None, self.kv_a_norm, self.eps)[0]
        q_pe, k_pe = ops.rotary(
            q_pe.contiguous(), k_pe.reshape(num_tokens, 1, self.rope).contiguous(), *cos_sin
        )
        row = torch.cat((latent, k_pe.reshape(num_tokens, self.rope)), dim=-1)[:, None]
        half = row.shape[-1] // 2
        scales = dict(k_scale=kv_scales[0], v_scale=kv_scales[1])
        reshape_and_cache_ref(
            row[..., :half], row[..., half:], layer_cache[0], layer_cache[1], meta.slot_mapping,
            **scales,
        )  # fmt: skip
        w_ukv = self.kv_b.view(self.heads, self.nope + self.v_dim, self.latent_rank)
        out = ops.mla_attention(
            q_nope, q_pe, layer_cache[0], layer_cache[1], meta.block_tables, meta.cu_seqlens_q,
            meta.seq_lens, w_ukv[:, : self.nope], w_ukv[:, self.nope :], scale, **scales,
        )  # fmt: skip
        return self.o_proj(out.to(h.dtype).reshape(num_tokens, self.heads * self.v_dim))
