"""One contract per kernel op: the torch twin (kernels/reference.py), the C kernels
(kernels/cpu_*.py) and the Triton kernels (kernels/kv_write.py, paged_attention.py,
block_ops.py) all satisfy these, positional parameters by the same names and in the same order
(tests/kernels/test_ops.py checks every implementation against them), so a backend can be
swapped without the engine knowing. Extra parameters an implementation takes must have
defaults (a twin's `decode` hook, Triton's `num_splits`).

Layouts: caches are [num_blocks, block_size, num_kv_heads, head_dim] per layer for K and V;
a slot is `block_id * block_size + offset`; block mappings are int64 [n, 2] (src, dst).
"""

from typing import Protocol

import torch


class ReshapeAndCache(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative: padding, not written
        *,
        k_scale: float = 1.0,  # an fp8 cache stores clamp(k / k_scale) to nearest even
        v_scale: float = 1.0,
    ) -> None:
        """Write each token's K/V row into its slot of the caches (cast to their dtype, or
        quantised for an fp8 one: float8_e4m3fn, float8_e5m2)."""


class PagedAttention(Protocol):
    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences back to back
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        cu_seqlens_q: torch.Tensor,  # int32 [num_seqs + 1]: query offsets
        seq_lens: torch.Tensor,  # int32 [num_seqs]: context lengths, new tokens included
        scale: float,
        max_seqlen_q: int,
        *,
        # a key at j is seen from i iff i - window < j <= i; 0: every key; negative: chunked
        # local attention, iff C * (i // C) <= j <= i for C = -window (Llama 4)
        window: int = 0,
        softcap: float = 0.0,  # scores become softcap * tanh(score / softcap); 0: none
        k_scale: float = 1.0,  # an fp8 cache's K are stored / k_scale: read as q * k_scale
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,  # fp32 [num_heads]: a logit per head that joins
        # every softmax's denominator and adds no value (gpt-oss); None: none
    ) -> torch.Tensor:
        """Causal attention of a mixed batch over paged K/V: [num_tokens, num_heads, head_dim]
        in query's dtype. The new tokens' K/V are in the cache already. The caches are in
        query's dtype, or fp8 (dequantised as read); other caches ignore the scales."""


class CopyBlocks(Protocol):
    def __call__(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """Copy whole blocks within a cache [layers, 2, num_blocks, ...] (copy-on-write)."""


class SwapBlocks(Protocol):
    def __call__(
        self, src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
    ) -> None:
        """Copy blocks between a device cache and the CPU pool, either way."""


class Rotary(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by the positions' cos/sin (may work in place: use what it returns)."""


class AddRmsNorm(Protocol):
    def __call__(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new residual): residual + delta (delta None: residual alone), RMS-normed
        over its last dimension and scaled by `weight`: of residual's dtype (Llama's rule), or
        float32 beside bf16 rows (Gemma's, scaled in fp32 before the one rounding;
        kernels/reference.py). Residual is [T, hidden], or with delta None [T, heads, d], a
        q or k view whose heads are normed each (q/k norms)."""


class SiluAndMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up over the two halves of the last dimension."""


class GeluTanhAndMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up over the two halves of the last dimension (GeGLU)."""


class GeluAndMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up (exact, erf) over the two halves of the last dimension."""


class FusedMoe(Protocol):
    def __call__(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
        down: torch.Tensor,  # [num_experts, hidden, intermediate]
        topk_weights: torch.Tensor,  # [num_tokens, top_k]
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:
        """Routed experts: each token's top-k experts' MLPs, weighted and summed."""


class MlaAttention(Protocol):
    def __call__(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotated
        key_cache: torch.Tensor,  # latent pages: [num_blocks, block_size, 1, (L + r) / 2]
        value_cache: torch.Tensor,  # (a row [latent | rope key] split in halves over both)
        block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
        cu_seqlens_q: torch.Tensor,  # int32 [num_seqs + 1]
        seq_lens: torch.Tensor,  # int32 [num_seqs]: context lengths, new tokens included
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, L]: kv_b_proj's key rows
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, L]: its value rows
        scale: float,
        *,
        k_scale: float = 1.0,  # an fp8 page's halves' scales; other pages ignore them
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """DeepSeek's latent attention over latent pages (engine/model/mla.py): causal, fp32
        [num_tokens, num_heads, v_head_dim], before o_proj."""


CONTRACTS: dict[str, type] = {
    "reshape_and_cache": ReshapeAndCache,
    "paged_attention": PagedAttention,
    "copy_blocks": CopyBlocks,
    "swap_blocks": SwapBlocks,
    "rotary": Rotary,
    "add_rms_norm": AddRmsNorm,
    "silu_and_mul": SiluAndMul,
    "gelu_tanh_and_mul": GeluTanhAndMul,
    "gelu_and_mul": GeluAndMul,
    "fused_moe": FusedMoe,
    "mla_attention": MlaAttention,
}
