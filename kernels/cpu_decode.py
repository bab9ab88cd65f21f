"""The CPU attention kernel (kernels/cpu/paged_decode.c): built once, called via ctypes.

Why C here: on CPU the torch twin gathers every sequence's K/V blocks into a padded copy and then
runs SDPA, reading and writing the context three times; the kernel reads each K/V row once, in
place, through the block table. It takes one query token per row, so a short prefill chunk runs on
it too, a row per token over the keys that token sees; chunks of PREFILL_MIN_CHUNK tokens or more
go to the prefill kernel (kernels/cpu_prefill.py: flash-style, in place too), or, where that one
does not fit, to SDPA's matmuls over gathered copies. It is the CPU counterpart of the Triton
kernel, tested against the same torch twin.

Built and loaded by kernels/cpu_build.py.
"""

import torch
import torch.nn.functional as F
from kvpager.kernels import cpu_prefill
from kvpager.kernels.cpu_build import FLOAT, I64, NATIVE, PTR, load_library
from kvpager.kernels.cpu_layer_ops import rows_of_heads
from kvpager.kernels.reference import (
    FP8_DTYPES,
    _visible,
    chunk_attention_ref,
    decode_attention_ref,
    gather_context,
    paged_attention_ref,
    with_sink_column,
)

_ARGTYPES = (PTR, I64, PTR, PTR, PTR, I64, PTR, PTR) + (I64,) * 6 + (FLOAT, I64, FLOAT, PTR)
# the kernel's entry point for each cache dtype (fp8 ones decoded by kernels/cpu/fp8.h)
_FUNCTIONS = {
    torch.float32: "paged_decode_f32",
    torch.bfloat16: "paged_decode_bf16",
    torch.float8_e4m3fn: "paged_decode_fp8_e4m3",
    torch.float8_e5m2: "paged_decode_fp8_e5m2",
}
_SIGNATURES = tuple((name, _ARGTYPES) for name in _FUNCTIONS.values())


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/paged_decode.c) for `march` (the host's; tests also
    load AVX2's), or None when it cannot be built."""
    return load_library("paged_decode", _SIGNATURES, march)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One query token per sequence over paged K/V: fp32 [num_seqs, heads, d], or None when the
    kernel does not take these inputs (then the caller uses the torch twin). window, softcap,
    k_scale, v_scale, sinks: as kernels/reference.py's."""
    library = load()
    if library is None or key_cache.dtype not in _FUNCTIONS or value_cache.dtype != key_cache.dtype:
        return None
    if key_cache.dtype not in FP8_DTYPES:  # scales are an fp8 cache's
        k_scale = v_scale = 1.0
    # an fp8 cache's scales are linear: k_scale joins the softmax scale, v_scale the output
    out = call_decode_kernel(
        getattr(library, _FUNCTIONS[key_cache.dtype]), query.float(), key_cache, value_cache,
        block_tables, seq_lens, scale * k_scale, window, softcap, sinks=sinks,
    )  # fmt: skip
    return out.mul_(v_scale) if out is not None and v_scale != 1.0 else out


def call_decode_kernel(
    function, query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap,
    cu_seqlens_q=None, sinks=None, out_dtype=torch.float32,
) -> torch.Tensor | None:  # fmt: skip
    """A C kernel with paged_decode.c's entry point (its query in the kernel's dtype), or with
    a varlen batch's `cu_seqlens_q` after the block tables (paged_tiles.c's): [num_tokens,
    heads, d] in `out_dtype` (the one `function` writes: fp32 but for paged_tiles.c's bf16
    entry), or None when the caches are not contiguous or it declines.
    sinks: fp32 [heads] (passed as a pointer) or None (NULL)."""
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    if not rows_of_heads(query):  # rows may be apart (a qkv view)
        query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    starts = () if cu_seqlens_q is None else (cu_seqlens_q.to(torch.int32).contiguous(),)
    out = torch.empty(query.shape, dtype=out_dtype)
    _, num_heads, head_dim = query.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (num_heads,), f"sinks {tuple(sinks.shape)} for {num_heads} heads"
    _, block_size, num_kv_heads, _ = key_cache.shape
    status = function(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), *(t.data_ptr() for t in starts),
        seq_lens.data_ptr(), out.data_ptr(), len(seq_lens), num_heads, num_kv_heads, head_dim,
        block_size, torch.get_num_threads(), scale, window or 0, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
    )  # fmt: skip
    return None if status != 0 else out


def _decode_rows(
    query, key_cache, value_cache, block_tables, seq_lens, scale, window=0, softcap=0.0, *,
    k_scale=1.0, v_scale=1.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    args = (query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap)
    extra = dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    out = paged_decode(*args, **extra)
    return decode_attention_ref(*args, **extra) if out is None else out


# Prefill chunks this long or longer go to SDPA (blocked matmuls over a gathered copy of the
# context); shorter ones run on the kernel, a row per query token, where SDPA's per-sequence
# setup costs more than its matmuls save; from about this length the matmuls win.
SDPA_MIN_CHUNK = 128
# A bf16 model's chunks go to bf16 SDPA from 16 tokens (on a bf16 host SDPA won from there,
# the kernel below it): suffixes after a cached prefix are short.
BF16_SDPA_MIN_CHUNK = 16
# Where the prefill kernel fits (cpu_prefill.fits), chunks from this length run on it: on a loaded
# 2-core AVX-512 host (1 thread, CPU time) it beat the row-per-token kernel 1.1-2x from 8 tokens,
# and SDPA over gathered copies 1.3-2.4x on 256- and 512-token chunks
# (benchmarks/reports/2026-12-05-cpu-prefill-attention/). Rows read the context once a token,
# the kernel once a chunk, so where the cache is 4 bytes a value it pays sooner: a speculative
# verify chunk of 3-5 tokens over 500-3,000 keys ran 1.10-1.59x faster in fp32 on the 2-core
# Xeon over two runs (2 tokens: 0.93-1.19x); in bf16 (token-major) rows still won at 2-3
# tokens and lost from 5 (benchmarks/reports/2026-12-07-xeon-amx-fp32-tiles/)
PREFILL_MIN_CHUNK = 8
PREFILL_MIN_CHUNK_F32 = 3


def token_rows(
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every query token: its sequence's index and the context it sees (causal: the keys
    up to its own position). q_lens int64 [num_seqs]: new tokens per sequence."""
    num_tokens = int(cu_seqlens_q[-1])
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(q_lens)), q_lens, output_size=num_tokens
    )
    # token i of a chunk of q_len new tokens sits at position seq_len - q_len + i
    offset_in_chunk = torch.arange(num_tokens) - cu_seqlens_q[:-1].long()[seq_of_token]
    context = (seq_lens.long() - q_lens)[seq_of_token] + offset_in_chunk + 1
    return seq_of_token, context.to(torch.int32)


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` with decode tokens and short prefill chunks on the C kernel, read
    in place through the block tables (bf16 and fp8 caches without widening), and chunks of
    PREFILL_MIN_CHUNK tokens or more on the prefill kernel, in place too, where it fits
    (cpu_prefill.fits). Where it does not: chunks of SDPA_MIN_CHUNK tokens or more on the
    twin's SDPA (fp8 dequantised on its gather); a bf16 model's from BF16_SDPA_MIN_CHUNK, on
    SDPA in bf16, assembled in bf16 (sinks as one more key column: reference.with_sink_column).
    Returns query's dtype."""
    args = (key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q)
    scales = dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    masking = dict(window=window, softcap=softcap, **scales)
    if max_seqlen_q == 1:
        out = _decode_rows(query, *args[:3], seq_lens, scale, window, softcap, **scales)
        return out.to(query.dtype)
    in_place = cpu_prefill.fits(query, key_cache, value_cache)
    native_bf16 = not in_place and _native_bf16_chunks(query, key_cache, softcap)
    if in_place:
        min_chunk = prefill_min_chunk(key_cache)
    else:
        min_chunk = BF16_SDPA_MIN_CHUNK if native_bf16 else SDPA_MIN_CHUNK
    out = torch.empty(query.shape, dtype=query.dtype if native_bf16 else torch.float32)
    long_chunks = _short_rows(query, *args[:-1], min_chunk, out, **masking)
    if long_chunks is None:
        return paged_attention_ref(query, *args, decode=_decode_rows, **masking)
    chunks = (window, softcap, (k_scale, v_scale), sinks)
    if native_bf16:
        _bf16_chunk_attention(query, *args[:-1], long_chunks, out, window, sinks)
    elif not (in_place and cpu_prefill.prefill_chunks(query, *args[:-1], min_chunk, out, *chunks)):
        chunk_attention_ref(query, *args[:-1], long_chunks, out, *chunks)
    return out.to(query.dtype)


def prefill_min_chunk(key_cache: torch.Tensor) -> int:
    """Chunks from this many tokens run on the prefill kernel, by the cache's bytes a value."""
    return PREFILL_MIN_CHUNK_F32 if key_cache.element_size() == 4 else PREFILL_MIN_CHUNK


def _short_rows(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, min_chunk, out,
    window=0, softcap=0.0, *, k_scale=1.0, v_scale=1.0, sinks=None,
) -> torch.Tensor | None:  # fmt: skip
    """The rows of chunks under `min_chunk` tokens (decode tokens among them) on the C kernel,
    a row per query token over the keys it sees, into `out`. Returns which sequences are left
    (bool [num_seqs]: their chunks are long), or None where the kernel declines."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of_token, context = token_rows(cu_seqlens_q, seq_lens, q_lens)
    short = torch.nonzero((q_lens < min_chunk)[seq_of_token]).flatten()
    if short.numel():
        tables = block_tables.index_select(0, seq_of_token[short])
        rows = paged_decode(
            query[short], key_cache, value_cache, tables, context[short], scale, window, softcap,
            k_scale=k_scale, v_scale=v_scale, sinks=sinks,
        )  # fmt: skip
        if rows is None:
            return None
        if short.numel() == query.shape[0]:  # every row: a plain copy, not a scatter
            out.copy_(rows)
        else:
            out[short] = rows.to(out.dtype)
    return q_lens >= min_chunk


def _native_bf16_chunks(query: torch.Tensor, key_cache: torch.Tensor, softcap: float) -> bool:
    """Long chunks of a bf16 model over a bf16 cache run SDPA in bf16 (fp32 softmax and
    accumulation inside torch's flash kernel, AMX/AVX-512-BF16 matmuls), rather than in fp32
    over widened copies. Soft-capped layers keep the twin's written-out fp32 path."""
    return query.dtype == key_cache.dtype == torch.bfloat16 and not softcap


def _bf16_chunk_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, chosen, out,
    window=0, sinks=None,
) -> None:  # fmt: skip
    """chunk_attention_ref's contract (rows of `chosen` sequences into `out`), in bf16, over
    gathered copies of their context; sinks as one more key column (with_sink_column)."""
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for seq_idx in torch.nonzero(chosen).flatten().tolist():
        start, end, seq_len = starts[seq_idx], starts[seq_idx + 1], lens[seq_idx]
        k, v = (
            gather_context(cache, block_tables[seq_idx], seq_len).transpose(0, 1).unsqueeze(0)
            for cache in (key_cache, value_cache)
        )
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
        q_len = end - start
        if q_len == seq_len and not window and sinks is None:  # no cached context: plain causal
            mask, causal = None, True
        else:  # query i sits at position seq_len - q_len + i
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            mask, causal = _visible(q_pos, torch.arange(seq_len)[None, :], window), False
            k, v, mask = with_sink_column(k, v, mask, sinks, q.shape)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[start:end] = attended[0].transpose(0, 1)
