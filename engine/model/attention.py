"""Paged attention as the decoder calls it: write new K/V, then attend through block tables."""

from dataclasses import dataclass

import torch
from kvpager.kernels.backend import KernelOps


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors describing one flat batch of prefill chunks and decode tokens.

    slot_mapping  int64 [num_tokens]           where each new token's K/V goes
    block_tables  int32 [num_seqs, max_blocks] physical block of each logical block
    cu_seqlens_q  int32 [num_seqs + 1]         query offsets of each sequence in the batch
    seq_lens      int32 [num_seqs]             context length after this step
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int


class PagedAttention:
    def __init__(self, ops: KernelOps, scale: float) -> None:
        self.ops = ops
        self.scale = scale

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int = 0,
        softcap: float = 0.0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d], layer_cache [2, num_blocks, bs, kv_heads, d];
        the layer's sliding window (0: full), attention soft-cap (0: none), and its fp8
        cache's scales (engine/model/kv_scales.py; other caches ignore them); sinks: fp32
        [heads] (gpt-oss) or None."""
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, **scales)
        if sinks is not None:  # gpt-oss's; other families' calls stay as they were
            scales["sinks"] = sinks
        return self.ops.paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            self.scale,
            meta.max_seqlen_q,
            window=window,
            softcap=softcap,
            **scales,
        )
