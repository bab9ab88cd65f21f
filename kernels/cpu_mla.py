"""Latent attention on the CPU (kernels/cpu/mla_decode.c): decode tokens and short prefill
chunks on the C kernel, a row per query token over the latent pages read in place; long
chunks on the torch twin (kernels/reference_mla.py: mla_paged_attention_ref, up-projected
per-head K / V, where matmuls win). Routed by the cpu backend (kernels/backend.py).
"""

import torch
from kvpager.kernels.cpu_build import FLOAT, I64, NATIVE, PTR, load_library
from kvpager.kernels.cpu_decode import token_rows
from kvpager.kernels.mla_absorb import absorbed_query, latent_output
from kvpager.kernels.reference import FP8_DTYPES
from kvpager.kernels.reference_mla import mla_paged_attention_ref

_ARGTYPES = (PTR, PTR, PTR, PTR, I64, PTR, PTR) + (I64,) * 5 + (FLOAT,)
_FUNCTIONS = {
    torch.float32: "mla_decode_f32",
    torch.bfloat16: "mla_decode_bf16",
    torch.float8_e4m3fn: "mla_decode_fp8_e4m3",
    torch.float8_e5m2: "mla_decode_fp8_e5m2",
}
_SIGNATURES = tuple((name, _ARGTYPES) for name in _FUNCTIONS.values())
# Chunks this long or longer go to the twin's up-projected matmuls; shorter ones (decode
# tokens, suffixes after a cached prefix) run on the kernel a row per token.
TWIN_MIN_CHUNK = 16


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/mla_decode.c) for `march`, or None."""
    return load_library("mla_decode", _SIGNATURES, march)


def mla_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """The C kernel: query fp32 [rows, H, 2 * half] (kernels/mla_absorb.py: absorbed_query),
    latent pages [num_blocks, block_size, 1, half], a table row and a context length per
    query row. fp32 [rows, H, 2 * half] of stored values, or None where it declines."""
    library = load()
    if library is None or key_cache.dtype not in _FUNCTIONS or value_cache.dtype != key_cache.dtype:
        return None
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    query = query.float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_rows, num_heads, row = query.shape
    status = getattr(library, _FUNCTIONS[key_cache.dtype])(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), num_rows, num_heads, row // 2,
        key_cache.shape[1], torch.get_num_threads(), scale,
    )  # fmt: skip
    return None if status != 0 else out


def mla_attention_cpu(
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
    """mla_paged_attention_ref's contract (fp32 [T, H, v]) with the rows of chunks under
    TWIN_MIN_CHUNK tokens on the C kernel (absorbed), the rest on the twin."""
    args = (key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, w_uk, w_uv, scale)
    scales = (k_scale, v_scale) if key_cache.dtype in FP8_DTYPES else (1.0, 1.0)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of_token, context = token_rows(cu_seqlens_q, seq_lens, q_lens)
    short = torch.nonzero((q_lens < TWIN_MIN_CHUNK)[seq_of_token]).flatten()
    out = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1], dtype=torch.float32)
    if short.numel():
        query = absorbed_query(q_nope[short], q_pe[short], w_uk, key_cache.shape[-1], scales)
        tables = block_tables.index_select(0, seq_of_token[short])
        rows = mla_decode(query, key_cache, value_cache, tables, context[short], scale)
        if rows is None:
            return mla_paged_attention_ref(q_nope, q_pe, *args, k_scale=k_scale, v_scale=v_scale)
        out[short] = latent_output(rows, w_uv, scales)
    if short.numel() < q_nope.shape[0]:
        _long_chunks(q_nope, q_pe, *args, q_lens >= TWIN_MIN_CHUNK, out, scales)
    return out


def _long_chunks(
    q_nope, q_pe, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, w_uk, w_uv,
    scale, chosen, out, scales,
) -> None:  # fmt: skip
    """The twin over the `chosen` sequences (bool [num_seqs]) as a batch of their own, into
    their rows of `out`."""
    seqs = torch.nonzero(chosen).flatten()
    starts = cu_seqlens_q.long()
    rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs.tolist()])
    q_lens = (starts[1:] - starts[:-1])[seqs]
    cu = torch.cat((q_lens.new_zeros(1), q_lens.cumsum(0))).to(torch.int32)
    out[rows] = mla_paged_attention_ref(
        q_nope[rows], q_pe[rows], key_cache, value_cache, block_tables.index_select(0, seqs),
        cu, seq_lens.index_select(0, seqs), w_uk, w_uv, scale, k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
