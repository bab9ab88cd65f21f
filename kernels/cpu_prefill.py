"""The CPU prefill-attention kernel (kernels/cpu/paged_prefill.c): long prefill chunks over the
token-major paged cache, read in place through the block tables, built once, called via ctypes.

Why C here: the torch twin (reference.chunk_attention_ref) gathers each chunk's whole context
into a contiguous copy, widened to fp32, and runs SDPA on it; the kernel reads each step of
keys once per query tile into a buffer that stays in cache and runs flash-style (online
softmax) over it, with no copy of the context. Its torch twin is chunk_attention_ref; the
tests compare them (tests/kernels/test_cpu_prefill.py).

Built and loaded by kernels/cpu_build.py.
"""

import torch
from kvpager.kernels.cpu_build import FLOAT, I64, NATIVE, PTR, load_library
from kvpager.kernels.cpu_layer_ops import rows_of_heads
from kvpager.kernels.reference import FP8_DTYPES

_ARGTYPES = (PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, PTR) + (I64,) * 6 + (FLOAT, I64, FLOAT)
_ARGTYPES += (PTR, I64)
# the kernel's entry point for each cache dtype (fp8 ones decoded by kernels/cpu/fp8.h)
_FUNCTIONS = {
    torch.float32: "paged_prefill_f32",
    torch.bfloat16: "paged_prefill_bf16",
    torch.float8_e4m3fn: "paged_prefill_fp8_e4m3",
    torch.float8_e5m2: "paged_prefill_fp8_e5m2",
}
_SIGNATURES = (("prefill_lanes", ()), *((name, _ARGTYPES) for name in _FUNCTIONS.values()))
MAX_DIM, MAX_GROUP = 256, 64  # paged_prefill.c's MAX_DIM and MAX_ROWS


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/paged_prefill.c) for `march` (the host's; tests also
    load AVX2's), or None when it cannot be built."""
    return load_library("paged_prefill", _SIGNATURES, march)


def fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel takes chunks of this query over these caches here: built, a cache
    dtype it reads, head_dim a multiple of its lanes (16 on AVX-512 hosts, 8 on AVX2 ones)
    up to MAX_DIM, at most MAX_GROUP query heads a kv head."""
    library = load()
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    return (
        library is not None
        and key_cache.dtype in _FUNCTIONS
        and value_cache.dtype == key_cache.dtype
        and not query.is_cuda
        and head_dim % library.prefill_lanes() == 0
        and head_dim <= MAX_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def prefill_chunks(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    min_q_len: int,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sinks: torch.Tensor | None = None,
    march: str = NATIVE,
) -> bool:
    """The rows of every chunk of `min_q_len` tokens or more, each attending causally over its
    cached context, written into `out` (fp32 [num_tokens, heads, d], contiguous): the contract
    of reference.chunk_attention_ref for those chunks. Returns False, writing nothing, where
    the kernel does not take these inputs (then the caller runs the twin). kv_scales: an fp8
    cache's (k_scale, v_scale); window, softcap, sinks: as kernels/reference.py's."""
    library = load(march)
    if library is None or not _takes(query, key_cache, value_cache, out):
        return False
    k_scale, v_scale = kv_scales if key_cache.dtype in FP8_DTYPES else (1.0, 1.0)
    query = query if query.dtype == torch.float32 else query.float()
    if not rows_of_heads(query):  # rows may be apart (a qkv view)
        query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts, lens = (t.to(torch.int32).contiguous() for t in (cu_seqlens_q, seq_lens))
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (num_heads,), f"sinks {tuple(sinks.shape)} for {num_heads} heads"
    status = getattr(library, _FUNCTIONS[key_cache.dtype])(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), out.data_ptr(),
        len(lens), num_heads, num_kv_heads, head_dim, block_size, torch.get_num_threads(),
        scale * k_scale, window or 0, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), max(min_q_len, 1),
    )  # fmt: skip
    if status != 0:
        return False
    if v_scale != 1.0:  # linear: the output of the chunks' rows alone
        chosen = (starts[1:] - starts[:-1]) >= max(min_q_len, 1)
        for start, end in zip(starts[:-1][chosen].tolist(), starts[1:][chosen].tolist()):
            out[start:end].mul_(v_scale)
    return True


def _takes(query, key_cache, value_cache, out) -> bool:
    """Inputs the kernel reads as they are: a known cache dtype shared by K and V, contiguous
    caches, an fp32 contiguous output of the query's shape, and a host that lets it build."""
    return (
        key_cache.dtype in _FUNCTIONS
        and value_cache.dtype == key_cache.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.shape == query.shape
        and not query.is_cuda
    )
