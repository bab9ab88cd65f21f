"""Attention sinks (gpt-oss: a learned logit per query head that joins every softmax's
denominator and adds no value) in every attention path: the torch twin against dense fp64
attention written as transformers' eager gpt-oss writes it (a sink column, softmax, column
dropped), and the C kernels (token-major decode rows, SDPA chunks in fp32 and bf16, the tile
layout), the Triton kernel (TRITON_INTERPRET=1 on CPU; single pass and split-KV) against the
twin: decode, prefill and mixed batches, with sliding windows, beside Llama 4's chunked
attention (window -16: sinks and chunk masks together), and over fp8 caches."""

import pytest
import torch
from kvpager.kernels import cpu_decode, cpu_tiles
from kvpager.kernels.cpu_decode import paged_attention_cpu
from kvpager.kernels.paged_attention import paged_attention
from kvpager.kernels.reference import paged_attention_ref, quantise_ref

from tests.kernels.test_paged_attention import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    Batch,
    assert_close,
    make_batch,
)

needs_c = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler here")
# a long chunk: the prefill kernel (SDPA where it does not fit)
LONG_PREFILL = ([130, 1, 20], [150, 40, 20])
CASES = [DECODE, MIXED, PREFILL, CHUNKED]
WINDOWS = [0, 5, 16, -16]  # -16: chunks of 16 tokens


def sinks_for(num_heads: int) -> torch.Tensor:
    """Sinks large enough to take most of some heads' mass and little of others'."""
    gen = torch.Generator().manual_seed(num_heads)
    return torch.randn(num_heads, generator=gen) * 2.0 + 1.0


def dense_with_sinks(batch: Batch, scale: float, window: int, sinks: torch.Tensor):
    """fp64 causal attention within `window` (< 0: the query's chunk of -window keys), each
    head's sink as one more logit."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.cu_seqlens_q.tolist()
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    for seq_idx, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = batch.query[start:end].double().transpose(0, 1)  # [heads, q_len, d]
        q_pos = torch.arange(len(keys) - (end - start), len(keys))[:, None]
        k_pos = torch.arange(len(keys))[None, :]
        if window < 0:
            hidden = (k_pos > q_pos) | (k_pos // -window != q_pos // -window)
        else:
            hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(hidden, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, end - start, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[start:end] = (probs @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("case", [*CASES, LONG_PREFILL])
@pytest.mark.parametrize("window", WINDOWS)
def test_twin_matches_dense(case, window):
    batch = make_batch(*case, 4, 2, 16, 4, torch.float32, "cpu")
    sinks = sinks_for(4)
    out = paged_attention_ref(*batch.args(0.3), window=window, sinks=sinks)
    assert_close("twin", out, dense_with_sinks(batch, 0.3, window, sinks), torch.float32)
    without = paged_attention_ref(*batch.args(0.3), window=window)
    assert (out - without).abs().max() > 1e-2  # the sinks matter here


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [0, 16, -16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(case, window, dtype):
    batch = make_batch(*case, 8, 2, 64, 8, dtype, "cpu")
    args, sinks = batch.args(0.125), sinks_for(8)
    expected = paged_attention_ref(*args, window=window, sinks=sinks)
    for num_splits in (1, 3):  # split-KV: the reducer joins the sink once
        out = paged_attention(*args, num_splits=num_splits, window=window, sinks=sinks)
        assert_close(f"triton, {num_splits} splits", out, expected, dtype)


@needs_c
@pytest.mark.parametrize("case", [*CASES, LONG_PREFILL])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "dtype"), [(64, 9, torch.bfloat16), (16, 4, torch.float32)]
)
def test_c_kernel_matches_twin(case, window, head_dim, num_heads, dtype):
    """Literal-size (64, group 3) and runtime-size (16) paths of the C kernel; long chunks on
    SDPA with the sink column (in bf16 for a bf16 model)."""
    batch = make_batch(*case, num_heads, num_heads // 3 or 1, head_dim, 16, dtype, "cpu")
    args, sinks = batch.args(head_dim**-0.5), sinks_for(num_heads)
    out = paged_attention_cpu(*args, window=window, sinks=sinks)
    assert_close("C", out, paged_attention_ref(*args, window=window, sinks=sinks), dtype)


@needs_c
@pytest.mark.parametrize("case", [DECODE, MIXED])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_with_sinks(case, fp8):
    """An fp8 cache: the C kernel and Triton against the twin, which dequantises on gather."""
    batch = make_batch(*case, 4, 2, 16, 8, torch.float32, "cpu")
    k_scale, v_scale = 0.5, 0.25
    batch.key_cache = quantise_ref(batch.key_cache, fp8, k_scale)
    batch.value_cache = quantise_ref(batch.value_cache, fp8, v_scale)
    args, sinks = batch.args(0.25), sinks_for(4)
    extra = dict(k_scale=k_scale, v_scale=v_scale, sinks=sinks, window=5)
    expected = paged_attention_ref(*args, **extra)
    assert_close("C fp8", paged_attention_cpu(*args, **extra), expected, torch.float32)
    assert_close("triton fp8", paged_attention(*args, **extra), expected, torch.float32)


tiles = pytest.mark.skipif(not cpu_tiles.available(), reason="no AMX or AVX512-BF16 here")


@tiles
@pytest.mark.parametrize("case", [DECODE, MIXED, CHUNKED, LONG_PREFILL])
@pytest.mark.parametrize("window", [0, 21, -16])
def test_tile_layout_matches_twin(case, window):
    """The tile kernel's decode units (a kv head's group of query heads: a sink each row) and
    prefill units (16 tokens under one head: one sink for all rows)."""
    batch = make_batch(*case, 8, 2, 64, 16, torch.bfloat16, "cpu")
    args, sinks = batch.args(0.125), sinks_for(8)
    expected = paged_attention_ref(*args, window=window, sinks=sinks)
    key_tiles = cpu_tiles.to_tiles(batch.key_cache, value=False)
    value_tiles = cpu_tiles.to_tiles(batch.value_cache, value=True)
    tiled = (args[0], key_tiles, value_tiles, *args[3:])
    out = cpu_tiles.paged_attention_tiles(*tiled, window=window, sinks=sinks)
    assert_close("tiles", out, expected, torch.bfloat16)
    assert cpu_tiles._tile_attention(*tiled[:7], window, 0.0, sinks) is not None  # the kernel ran
