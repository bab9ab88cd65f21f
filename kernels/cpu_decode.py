"""The CPU decode-attention kernel (kernels/cpu/paged_decode.c): built once, called via ctypes.

Why C here: on CPU the torch twin gathers every sequence's K/V blocks into a padded copy and
then runs SDPA, reading and writing the context three times; the kernel reads each K/V row once,
in place, through the block table (SmolLM2, 48 sequences of ~250 tokens: attention per decode
step 124 ms -> 41-55 ms). It is the CPU counterpart of the Triton kernel, tested against the
same torch twin.

Built and loaded by kernels/cpu_build.py.
"""

import functools

import torch

from kernels.cpu_build import FLOAT, I64, PTR, load_library
from kernels.reference import decode_attention_ref, paged_attention_ref

_ARGTYPES = (PTR, I64, PTR, PTR, PTR, I64, PTR, PTR) + (I64,) * 6 + (FLOAT,)
_SIGNATURES = (("paged_decode_f32", _ARGTYPES), ("paged_decode_bf16", _ARGTYPES))


def load():
    """The compiled library (kernels/cpu/paged_decode.c), or None when it cannot be built."""
    return load_library("paged_decode", _SIGNATURES)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """One query token per sequence over paged K/V: fp32 [num_seqs, heads, d], or None when the
    kernel does not take these inputs (then the caller uses the torch twin)."""
    library = load()
    if library is None or key_cache.dtype not in (torch.float32, torch.bfloat16):
        return None
    query = query.float()
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:  # rows may be apart (qkv view)
        query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    out = torch.empty(query.shape, dtype=torch.float32)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    function = (
        library.paged_decode_f32 if key_cache.dtype == torch.float32 else library.paged_decode_bf16
    )
    status = function(
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.get_num_threads(),
        scale,
    )
    return out if status == 0 else None


def _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    out = paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        return decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return out


# `paged_attention_ref` with its decode rows on the C kernel (prefill chunks stay on SDPA)
paged_attention_cpu = functools.partial(paged_attention_ref, decode=_decode_rows)
