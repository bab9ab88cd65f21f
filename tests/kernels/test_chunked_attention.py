"""Chunked local attention (Llama 4: `window` = -C, a query at i sees keys C * (i // C) .. i)
in every attention path: the torch twin against dense fp64 attention; the Triton kernel
(TRITON_INTERPRET=1 on CPU), the C decode kernel (decode rows and short prefill chunks) and
the C tile kernel against the twin; and an exact test of the chunk's edges with one-hot
values, so each output names the keys its query saw."""

import pytest
import torch
from kvpager.kernels import cpu_decode, cpu_tiles
from kvpager.kernels.cpu_decode import paged_attention_cpu
from kvpager.kernels.cpu_tiles import paged_attention_tiles
from kvpager.kernels.paged_attention import paged_attention
from kvpager.kernels.reference import paged_attention_ref

from tests.kernels.test_cpu_tiles import _tiled
from tests.kernels.test_paged_attention import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    Batch,
    assert_close,
    make_batch,
)
from tests.kernels.test_sliding_window import one_hot_batch, seen

needs_c = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler here")
needs_tiles = pytest.mark.skipif(not cpu_tiles.available(), reason="no AMX or AVX512-BF16")

CASES = [DECODE, MIXED, PREFILL, CHUNKED]
CHUNKS = [1, 4, 16, 32]


def dense_chunked(batch: Batch, scale: float, chunk: int) -> torch.Tensor:
    """Causal attention in fp64 inside each query's chunk of `chunk` keys."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.cu_seqlens_q.tolist()
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    for seq_idx, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = batch.query[start:end].double().transpose(0, 1)
        q_pos = torch.arange(len(keys) - (end - start), len(keys))[:, None]
        k_pos = torch.arange(len(keys))[None, :]
        hidden = (k_pos > q_pos) | (k_pos // chunk != q_pos // chunk)
        scores = q @ k.transpose(1, 2) * scale
        out[start:end] = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_twin_matches_dense(case, chunk):
    batch = make_batch(*case, 4, 2, 16, 4, torch.float32, "cpu")
    out = paged_attention_ref(*batch.args(0.3), window=-chunk)
    assert_close("twin", out, dense_chunked(batch, 0.3, chunk), torch.float32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(case, chunk, dtype):
    batch = make_batch(*case, 8, 2, 64, 8, dtype, "cpu")
    args = batch.args(0.125)
    expected = paged_attention_ref(*args, window=-chunk)
    for num_splits in (1, 3):  # split-KV: partitions wholly before a chunk hold no key
        out = paged_attention(*args, num_splits=num_splits, window=-chunk)
        assert_close(f"triton, {num_splits} splits", out, expected, dtype)


@needs_c
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "dtype"), [(64, 9, torch.bfloat16), (16, 4, torch.float32)]
)
def test_c_kernel_matches_twin(case, chunk, head_dim, num_heads, dtype):
    """Literal-size (64, group 3) and runtime-size (16) paths of the C decode kernel."""
    batch = make_batch(*case, num_heads, num_heads // 3 or 1, head_dim, 16, dtype, "cpu")
    args = batch.args(head_dim**-0.5)
    out = paged_attention_cpu(*args, window=-chunk)
    assert_close("C", out, paged_attention_ref(*args, window=-chunk), dtype)


@needs_tiles
@pytest.mark.parametrize("case", [MIXED, PREFILL, CHUNKED])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_tile_kernel_matches_twin(case, chunk):
    """The tile kernel's units of 16 query rows cross chunk edges (a row's first key moves)."""
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    out = paged_attention_tiles(*_tiled(batch).args(0.125), window=-chunk)
    expected = paged_attention_ref(*batch.args(0.125), window=-chunk)
    assert_close("tiles", out, expected, torch.bfloat16)


@pytest.mark.parametrize("chunk", [1, 8, 16, 24])
def test_chunk_edges_in_every_path(chunk):
    """Queries at positions 0..39 of one prompt and a decode row at 40, block size 8: query i
    sees exactly keys C * (i // C) .. i, in the twin, Triton and C alike."""
    batch = one_hot_batch([40, 1], [40, 41], 8)
    args = batch.args(1.0)
    positions = list(range(40)) + [40]
    expected = [list(range(i - i % chunk, i + 1)) for i in positions]
    paths = {
        "twin": paged_attention_ref(*args, window=-chunk),
        "triton": paged_attention(*args, window=-chunk),
        "triton split": paged_attention(*args, num_splits=2, window=-chunk),
    }
    if cpu_decode.load() is not None:
        paths["C"] = paged_attention_cpu(*args, window=-chunk)
    for name, out in paths.items():
        assert seen(out) == expected, name
