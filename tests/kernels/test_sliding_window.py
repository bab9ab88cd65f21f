"""Sliding windows and soft-capping in every attention path: the torch twin against dense
fp64 attention, the Triton kernel (TRITON_INTERPRET=1 on CPU) and the C kernel against the twin,
and an exact test of the window's edge: with equal keys each query averages one-hot values, so
the output names the keys it saw (transformers' rule: i - window < j <= i)."""

import pytest
import torch
from kvpager.kernels import cpu_decode
from kvpager.kernels.cpu_decode import paged_attention_cpu
from kvpager.kernels.paged_attention import paged_attention
from kvpager.kernels.reference import paged_attention_ref

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


def dense_windowed(batch: Batch, scale: float, window: int, softcap: float) -> torch.Tensor:
    """Causal attention in fp64 within `window` keys (0: all), scores soft-capped."""
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
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        scores = q @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[start:end] = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    return out


CASES = [DECODE, MIXED, PREFILL, CHUNKED]
MASKING = [(1, 0.0), (5, 0.0), (16, 0.0), (37, 2.0), (0, 1.5)]  # (window, softcap)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("window", "softcap"), MASKING)
def test_twin_matches_dense(case, window, softcap):
    batch = make_batch(*case, 4, 2, 16, 4, torch.float32, "cpu")
    out = paged_attention_ref(*batch.args(0.3), window=window, softcap=softcap)
    assert_close("twin", out, dense_windowed(batch, 0.3, window, softcap), torch.float32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("window", "softcap"), MASKING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(case, window, softcap, dtype):
    batch = make_batch(*case, 8, 2, 64, 8, dtype, "cpu")
    args = batch.args(0.125)
    expected = paged_attention_ref(*args, window=window, softcap=softcap)
    for num_splits in (1, 3):  # split-KV: partitions wholly left of a window hold no key
        out = paged_attention(*args, num_splits=num_splits, window=window, softcap=softcap)
        assert_close(f"triton, {num_splits} splits", out, expected, dtype)


@needs_c
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("window", "softcap"), MASKING)
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "dtype"), [(64, 9, torch.bfloat16), (16, 4, torch.float32)]
)
def test_c_kernel_matches_twin(case, window, softcap, head_dim, num_heads, dtype):
    """Literal-size (64, group 3) and runtime-size (16) paths of the C kernel."""
    batch = make_batch(*case, num_heads, num_heads // 3 or 1, head_dim, 16, dtype, "cpu")
    args = batch.args(head_dim**-0.5)
    out = paged_attention_cpu(*args, window=window, softcap=softcap)
    assert_close("C", out, paged_attention_ref(*args, window=window, softcap=softcap), dtype)


def one_hot_batch(q_lens: list[int], seq_lens: list[int], block_size: int) -> Batch:
    """Zero keys (every visible key weighs the same) and value j = e_j: each output row is
    the mean of the one-hot rows of the keys its query saw."""
    batch = make_batch(q_lens, seq_lens, 1, 1, 64, block_size, torch.float32, "cpu")
    batch.key_cache.zero_()
    for seq_idx, seq_len in enumerate(seq_lens):
        table = batch.block_tables[seq_idx].long()
        positions = torch.arange(seq_len)
        slots = table[positions // block_size] * block_size + positions % block_size
        batch.value_cache.view(-1, 64)[slots] = torch.eye(64)[:seq_len]
    return batch


def seen(out: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row[0] > 1e-6).flatten().tolist() for row in out]


@pytest.mark.parametrize("window", [1, 7, 8, 9, 31])
def test_window_edge_in_every_path(window):
    """Queries at positions 0..39 of one prompt and a decode row at 40, block size 8: query i
    sees exactly keys max(0, i - window + 1) .. i, in the twin, Triton and C alike."""
    batch = one_hot_batch([40, 1], [40, 41], 8)
    args = batch.args(1.0)
    positions = list(range(40)) + [40]
    expected = [list(range(max(0, i - window + 1), i + 1)) for i in positions]
    paths = {
        "twin": paged_attention_ref(*args, window=window),
        "triton": paged_attention(*args, window=window),
        "triton split": paged_attention(*args, num_splits=2, window=window),
    }
    if cpu_decode.load() is not None:
        paths["C"] = paged_attention_cpu(*args, window=window)
    for name, out in paths.items():
        assert seen(out) == expected, name
