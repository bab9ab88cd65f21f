"""The torch twins of latent attention (DeepSeek's MLA; kernels/mla_attention.py on Triton,
kernels/cpu_mla.py on CPU): up-projected for a prefill chunk, absorbed for decode, and over
the paged latent cache, in fp32."""

import torch
from kvpager.kernels.reference import gather_context


def _mla_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[t, S] causal: the query i (at position S - t + i) sees the keys at or before it."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)
    return torch.arange(num_keys, device=device)[None, :] <= q_pos[:, None]


def mla_prefill_ref(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """Latent attention with the latents up-projected to per-head K / V (a prefill chunk's
    way), in fp32. q_nope [t, H, n], q_pe [t, H, r] (rotated), latent [S, L], k_pe [S, r]
    (rotated) of the whole context, the t queries its last t positions; w_uk [H, n, L] and
    w_uv [H, v, L] (kv_b_proj's rows). Returns fp32 [t, H, v]."""
    q_nope, q_pe, latent, k_pe = q_nope.float(), q_pe.float(), latent.float(), k_pe.float()
    k_nope = torch.einsum("sl,hnl->shn", latent, w_uk.float())
    value = torch.einsum("sl,hvl->shv", latent, w_uv.float())
    scores = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_pe, k_pe)
    mask = _mla_mask(q_nope.shape[0], latent.shape[0], latent.device)
    probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shv->thv", probs, value)


def mla_decode_ref(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """mla_prefill_ref's result with W_UK absorbed into the query and W_UV applied after
    attention (decode's way): every head attends over the latents themselves, and no
    per-head K or V is ever formed. Same arguments, fp32 [t, H, v]."""
    q_nope, q_pe, latent, k_pe = q_nope.float(), q_pe.float(), latent.float(), k_pe.float()
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk.float())
    scores = torch.einsum("thl,sl->hts", q_latent, latent) + torch.einsum("thr,sr->hts", q_pe, k_pe)
    mask = _mla_mask(q_nope.shape[0], latent.shape[0], latent.device)
    probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("thl,hvl->thv", torch.einsum("hts,sl->thl", probs, latent), w_uv.float())


def mla_paged_attention_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Latent attention over latent pages: each token's row [latent (L) | rotary key (r)] is
    split in halves over key_cache and value_cache ([num_blocks, block_size, 1, (L + r) / 2]).
    A single-token query (decode) attends absorbed (mla_decode_ref), a longer chunk
    up-projected (mla_prefill_ref). Returns fp32 [T, H, v]."""
    latent_rank = w_uk.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float32)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for seq, num_keys in enumerate(lens):
        first, last = starts[seq], starts[seq + 1]
        if last == first:
            continue
        table = block_tables[seq]
        rows = torch.cat(
            (gather_context(key_cache, table, num_keys, k_scale),
             gather_context(value_cache, table, num_keys, v_scale)), dim=-1,
        )[:, 0].float()  # fmt: skip
        attend = mla_decode_ref if last - first == 1 else mla_prefill_ref
        out[first:last] = attend(
            q_nope[first:last], q_pe[first:last], rows[:, :latent_rank], rows[:, latent_rank:],
            w_uk, w_uv, scale,
        )  # fmt: skip
    return out
