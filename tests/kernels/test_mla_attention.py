"""Latent paged attention (DeepSeek's MLA): the Triton kernel (TRITON_INTERPRET=1 on CPU) and
the C kernel (host build and AVX2's) against the torch twin, mla_paged_attention_ref, on
mixed batches of decode tokens and prefill chunks over scrambled latent pages (the spare
blocks and table padding hold garbage); float32, bf16 and fp8 pages (with scales that are not
1). The cpu backend routes latent attention to the C kernel."""

import functools

import pytest
import torch
from kvpager.kernels import cpu_mla
from kvpager.kernels.backend import get_kernel_ops
from kvpager.kernels.cpu_mla import mla_attention_cpu
from kvpager.kernels.mla_attention import mla_paged_attention
from kvpager.kernels.reference_mla import mla_paged_attention_ref

from tests.kernels.test_fp8_kv import AVX2, SCALES
from tests.kernels.test_paged_attention import CHUNKED, DECODE, MIXED, PREFILL, make_batch

# (q_lens, seq_lens, num_heads, latent_rank, rope_dim, block_size): half = (L + r) / 2
SHAPES = [
    (*DECODE, 4, 24, 8, 16),  # the tiny DeepSeek configs' shape
    (*MIXED, 20, 56, 8, 8),  # two head tiles, the last one partly filled
    (*CHUNKED, 3, 24, 8, 4),
    (*PREFILL, 4, 56, 8, 16),
    ([3, 30, 1], [3, 47, 40], 4, 24, 8, 16),  # a long chunk beside short ones (the C route)
]
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
NOPE, V_DIM = 16, 12


def _batch(q_lens, seq_lens, heads, latent_rank, rope_dim, block_size, cache_dtype):
    """The twin's arguments: latent pages of `cache_dtype`, queries and W_UK / W_UV."""
    half = (latent_rank + rope_dim) // 2
    pages = make_batch(q_lens, seq_lens, 1, 1, half, block_size, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(sum(q_lens) + heads)
    num_tokens = sum(q_lens)
    q_nope = torch.randn(num_tokens, heads, NOPE, generator=gen)
    q_pe = torch.randn(num_tokens, heads, rope_dim, generator=gen)
    w_uk = torch.randn(heads, NOPE, latent_rank, generator=gen) * 0.3
    w_uv = torch.randn(heads, V_DIM, latent_rank, generator=gen) * 0.3
    caches = (pages.key_cache.to(cache_dtype), pages.value_cache.to(cache_dtype))
    tables = (pages.block_tables, pages.cu_seqlens_q, pages.seq_lens)
    return (q_nope, q_pe, *caches, *tables, w_uk, w_uv, (NOPE + rope_dim) ** -0.5)


def _scales(cache_dtype) -> dict[str, float]:
    """An fp8 page's scales; other pages must ignore them, so they get the same."""
    return dict(k_scale=SCALES[0], v_scale=SCALES[1])


def _check(kernel, shape, cache_dtype) -> None:
    args = _batch(*shape, cache_dtype)
    expected = mla_paged_attention_ref(*args, **_scales(cache_dtype))
    got = kernel(*args, **_scales(cache_dtype))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_triton_matches_the_twin(shape, cache_dtype):
    _check(mla_paged_attention, shape, cache_dtype)


@pytest.mark.skipif(cpu_mla.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("build", ["native", AVX2])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_c_matches_the_twin(shape, cache_dtype, build, monkeypatch):
    monkeypatch.setattr(cpu_mla, "load", functools.partial(cpu_mla.load, build))
    args = _batch(*shape, cache_dtype)
    rows = torch.zeros(1, shape[2], (shape[3] + shape[4]))
    assert cpu_mla.mla_decode(rows, *args[2:5], args[6][:1], 0.1) is not None  # not declined
    _check(mla_attention_cpu, shape, cache_dtype)


def test_cpu_backend_routes_latent_attention():
    assert get_kernel_ops("cpu").mla_attention is mla_attention_cpu
    assert get_kernel_ops("torch").mla_attention is mla_paged_attention_ref
