"""Pure-torch twins of the Triton kernels: obviously right, computed in fp32.

They share the launchers' signatures so tests can compare the two directly, and the engine's
torch attention backend (CPU serving) calls them. Attention takes a per-layer `window` (0:
full; else a key at position j is visible to the query at position i iff
i - window < j <= i, transformers' sliding-window mask; a negative one is chunked local
attention of C = -window tokens, Llama 4's: j is visible iff C * (i // C) <= j <= i) and a
`softcap` (0: none; else scores become softcap * tanh(scores / softcap) before masking, as
Gemma 2 does), and optional `sinks` (fp32 [num_heads]: gpt-oss's learned per-head logit that
joins every softmax's denominator and adds no value; None: none). An fp8 cache
(float8_e4m3fn or float8_e5m2) stores each K/V value x as q = clamp(x / scale) rounded to
nearest even, with a per-layer `k_scale` / `v_scale`, and
attention reads x = q * scale (`quantise_ref`, `dequantise_ref`); other caches store x cast to
their dtype and ignore the scales. Cache layout everywhere:

    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    key_cache = kv_cache[layer, 0]   value_cache = kv_cache[layer, 1]
    slot      = block_id * block_size + offset_in_block
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (query [S, heads, d], key_cache, value_cache, block_tables, seq_lens, scale, window, softcap,
# *, k_scale, v_scale) -> fp32 [S, heads, d]
DecodeFn = Callable[..., torch.Tensor]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantise_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: fp8 takes x / scale in fp32, clamped to the
    format's largest finite value and rounded to nearest even; any other dtype takes x cast."""
    if cache_dtype not in FP8_DTYPES:
        return x.to(cache_dtype)
    largest = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-largest, largest).to(cache_dtype)


def dequantise_ref(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache contents as values: fp8 widened to fp32 and times `scale`; others as they are."""
    return stored.float() * scale if stored.dtype in FP8_DTYPES else stored


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache viewed as uint8 (whole-block copies move bytes; torch lacks some indexing
    ops for fp8 on the CPU, index_copy_ among them); any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face computes it: normalise in fp32, then a weight of x's dtype scales the
    normalised x cast back (Llama's rule: `w * norm(x).to(dtype)`), and a float32 weight
    beside narrower x scales in fp32 before the one cast (Gemma's `(norm(x) * (1 + w))
    .to(dtype)`, its (1 + w) kept in fp32). In fp32 the two are the same."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (x32 * weight).to(x.dtype)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta); delta None adds nothing. Kernels may
    update `residual` in place: callers use the returned one."""
    if delta is not None:
        residual = residual + delta
    return rms_norm_ref(residual, weight, eps), residual


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, heads, d] and k [T, kv_heads, d]; cos/sin [T, d]
    are the tokens' rows of the tables (half-dim angles repeated). Kernels may rotate q and k
    in place: callers use the returned pair."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] -> silu(gate) * up, the gated MLP's activation (gate half first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] -> gelu_tanh(gate) * up, Gemma's GeGLU (gate half first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] -> gelu(gate) * up, exact (erf) GELU: transformers' "gelu" activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


def clamped_swiglu_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2 * inter] -> gpt-oss's clamped SwiGLU (gate half first): the gate clamped from
    above and the up half both ways to `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V rows into the paged caches at their slots; negative slots are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: int64 [num_tokens]; k_scale, v_scale: an fp8
    cache's (see the module docstring).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = quantise_ref(key[keep], key_cache.dtype, k_scale)
    value_cache[blocks, offsets] = quantise_ref(value[keep], value_cache.dtype, v_scale)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scale: float = 1.0
) -> torch.Tensor:
    """[num_tokens, num_kv_heads, head_dim] of one sequence, read through its block table
    (an fp8 cache dequantised on the gather, in fp32)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_table[:num_blocks].long()
    return dequantise_ref(cache.index_select(0, blocks).flatten(0, 1)[:num_tokens], scale)


def _attend(q, k, v, mask: torch.Tensor, scale: float, softcap: float = 0.0, sinks=None):
    """fp32 softmax attention. q [B, heads, q_len, d], k/v [B, kv_heads, kv_len, d] (any
    strides), mask bool broadcastable to [B, heads, q_len, kv_len]; GQA by head groups;
    sinks fp32 [heads] or None. SDPA has no soft-capping, so a capped layer takes the
    written-out path."""
    q, k, v = q.float(), k.float(), v.float()
    if not softcap:
        k, v, mask = with_sink_column(k, v, mask, sinks, q.shape)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # the sink's column joins the softmax, then is dropped
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v
    return scores.softmax(dim=-1) @ v  # [B, heads, q_len, d]


def with_sink_column(
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    q_shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """SDPA with attention sinks: one more key of zeros (score 0) whose additive mask is the
    head's sink, and a value of zeros, so the sink joins each softmax's denominator and adds
    nothing; the bool mask becomes an additive one in q's dtype (-inf where hidden). As they
    are when `sinks` is None. q_shape [B, heads, q_len, d]; mask None: causal is not allowed
    here (the caller passes an explicit mask)."""
    if sinks is None:
        return k, v, mask
    zeros = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros.to(v.dtype)], dim=2)
    batch, heads, q_len, _ = q_shape
    bias = torch.zeros((batch, heads, q_len, k.shape[2]), dtype=k.dtype, device=k.device)
    bias[..., :-1].masked_fill_(~mask, float("-inf"))
    bias[..., -1] = sinks.to(k.dtype).view(1, -1, 1)
    return k, v, bias


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool [..., q, k]: causal, and inside the window when there is one (window < 0: inside
    the query's chunk of -window tokens)."""
    visible = k_pos <= q_pos
    if window < 0:
        return visible & (k_pos >= q_pos - q_pos % -window)
    return visible & (k_pos > q_pos - window) if window else visible


def decode_attention_ref(
    query, key_cache, value_cache, block_tables, seq_lens, scale, window=0, softcap=0.0, *,
    k_scale=1.0, v_scale=1.0, sinks=None,
):  # fmt: skip
    """All sequences have one query token: one batched gather and attention, no Python loop."""
    num_seqs = query.shape[0]
    block_size = key_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long().flatten()
    # [num_seqs, kv_heads, num_blocks * block_size, d], padded past each sequence's length;
    # index_select copies whole blocks (advanced indexing goes element by element, 3x slower)
    k = key_cache.index_select(0, blocks).view(num_seqs, -1, *key_cache.shape[2:]).transpose(1, 2)
    v = value_cache.index_select(0, blocks).view(num_seqs, -1, *key_cache.shape[2:]).transpose(1, 2)
    k, v = dequantise_ref(k, k_scale), dequantise_ref(v, v_scale)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = _visible(seq_lens[:, None] - 1, positions[None, :], window).view(num_seqs, 1, 1, -1)
    return _attend(query.unsqueeze(2), k, v, mask, scale, softcap, sinks).squeeze(2)


def _sequence_attention(
    q_seq, key_cache, value_cache, block_table, seq_len, scale, window=0, softcap=0.0,
    kv_scales=(1.0, 1.0), sinks=None,
):  # fmt: skip
    """Causal attention of one sequence's query chunk over its whole cached context."""
    q_len = q_seq.shape[0]
    k = gather_context(key_cache, block_table, seq_len, kv_scales[0]).transpose(0, 1)
    v = gather_context(value_cache, block_table, seq_len, kv_scales[1]).transpose(0, 1)
    k, v = k.unsqueeze(0), v.unsqueeze(0)
    # query i sits at position seq_len - q_len + i and sees keys 0..that position
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q_seq.device)
    mask = _visible(q_pos[:, None], torch.arange(seq_len, device=q_seq.device)[None, :], window)
    # [1, heads, q_len, d]
    out = _attend(q_seq.transpose(0, 1).unsqueeze(0), k, v, mask, scale, softcap, sinks)
    return out[0].transpose(0, 1)


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    decode: DecodeFn = decode_attention_ref,
    *,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over paged K/V.

    query: [num_tokens, num_heads, head_dim], sequences packed back to back;
    caches: [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: int32
    [num_seqs, max_blocks_per_seq]; cu_seqlens_q: int32 [num_seqs + 1] query offsets;
    seq_lens: int32 [num_seqs] context length of each sequence *including* its new tokens,
    whose K/V must already be in the cache. num_heads is a multiple of num_kv_heads (GQA).
    Returns [num_tokens, num_heads, head_dim] in query's dtype. The one-token rows go to
    `decode` in one batch (the CPU backend passes its C kernel there). window, softcap,
    k_scale, v_scale, sinks: see the module docstring.
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if max_seqlen_q == 1:
        out = decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap,
            **scales,
        )  # fmt: skip
        return out.to(query.dtype)
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    one = torch.nonzero(q_lens == 1).flatten()
    if one.numel():  # the decode rows of a mixed batch still go in one batch
        rows = cu_seqlens_q[one].long()
        out[rows] = decode(
            query[rows], key_cache, value_cache, block_tables[one], seq_lens[one], scale,
            window, softcap, **scales,
        )  # fmt: skip
    chunk_attention_ref(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, q_lens > 1,
        out, window, softcap, (k_scale, v_scale), sinks,
    )  # fmt: skip
    return out.to(query.dtype)


def chunk_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    chosen: torch.Tensor,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sinks: torch.Tensor | None = None,
) -> None:
    """The query chunks of the sequences `chosen` (bool [num_seqs]), each attending causally
    over its cached context, into their rows of `out` (fp32 [num_tokens, heads, d]);
    kv_scales: an fp8 cache's (k_scale, v_scale); sinks: fp32 [heads] or None."""
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for seq_idx in torch.nonzero(chosen).flatten().tolist():
        start, end = starts[seq_idx], starts[seq_idx + 1]
        out[start:end] = _sequence_attention(
            query[start:end], key_cache, value_cache, block_tables[seq_idx], lens[seq_idx], scale,
            window, softcap, kv_scales, sinks,
        )  # fmt: skip


def copy_blocks_ref(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks within one cache, every layer, K and V (copy-on-write).

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
    block_mapping: int64 [num_pairs, 2] of (src_block, dst_block); no dst is also a src.
    """
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_cache = as_bytes(kv_cache)
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def swap_blocks_ref(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Move whole blocks between two caches (device <-> CPU pool), every layer, K and V.

    src_cache, dst_cache: [num_layers, 2, num_blocks_*, block_size, num_kv_heads, head_dim],
    possibly on different devices; block_mapping: int64 [num_pairs, 2] of
    (block in src_cache, block in dst_cache), on the CPU.
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(src_cache.device)
    dst = block_mapping[:, 1].to(dst_cache.device)
    src_cache, dst_cache = as_bytes(src_cache), as_bytes(dst_cache)
    dst_cache[:, :, dst] = src_cache[:, :, src].to(dst_cache.device)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Token by token: a clear bit forbids the token (twin of kernels/bitmask.py)."""
    words = bitmask.tolist()
    for j, row in enumerate(rows.tolist()):
        for token in range(min(logits.shape[1], 32 * len(words[j]))):
            if not (words[j][token // 32] >> (token % 32)) & 1:
                logits[row, token] = float("-inf")


def top_k_top_p_ref(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the top_k largest logits (ties with the k-th kept too), then the smallest prefix of
    the rest, by probability, whose mass reaches top_p; the others become -inf (a new tensor):
    each row sorted whole. top_k int64 [rows] (the vocab size: none), top_p float [rows] (1.0:
    none), or None."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 keep everything: rounding could push mass_before past 1.0.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def draw_ref(logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's inverse-CDF draw: the first token whose running probability mass, of
    softmax(logits * inv_temperature), passes u times the row's total; int64 [rows]."""
    cdf = (logits * inv_temperature.unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)


def small_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x [M, K] @ weight [N, K].T (+ bias) in float32, rounded once to x's dtype: the twin of
    kernels/small_linear.py (which reads oneDNN's packed copy of `weight`)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)
