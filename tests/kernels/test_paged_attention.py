"""paged_attention against its twin, and the twin against plain dense causal attention.

Batches are built from dense per-sequence K/V written into scrambled blocks of a cache full of
garbage, so the kernel, the twin and the dense computation all read the same numbers.
"""

from dataclasses import dataclass

import pytest
import torch
from kvpager.kernels.paged_attention import choose_num_splits, paged_attention
from kvpager.kernels.reference import paged_attention_ref


def _id(value):
    """Readable test ids: dtypes by name, batch cases by their table name."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    names = {id(case): name for name, case in CASES.items()}
    return names.get(id(value))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCES = {  # (atol, rtol) of the kernel against the fp32 twin, by dtype
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# (q_lens, seq_lens): seq_len counts the cached context plus the q_len new tokens
DECODE = ([1, 1, 1, 1], [1, 16, 37, 130])  # 1-token context, one block, ragged, 3 key tiles
PREFILL = ([1, 20, 70], [1, 20, 70])  # 1-token prompt, prompts across query tiles
MIXED = ([1, 5, 1, 33], [200, 5, 9, 90])  # decode, full prefill, decode, chunk after 57 cached
CHUNKED = ([7, 16], [100, 16])  # prefill chunk with cached context, then one full prompt
LONG = ([1, 1], [5000, 9000])  # GPU only: the default split-KV choice kicks in
CASES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED, "chunked": CHUNKED, "long": LONG}


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    keys: list[torch.Tensor]  # dense fp32 [seq_len, num_kv_heads, head_dim] per sequence
    values: list[torch.Tensor]

    def args(self, scale):
        max_seqlen_q = int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max())
        tensors = (self.query, self.key_cache, self.value_cache, self.block_tables)
        return (*tensors, self.cu_seqlens_q, self.seq_lens, scale, max_seqlen_q)


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """Random batch whose sequences own scrambled blocks; spare blocks and table padding hold
    garbage that must never be read."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim + num_heads)
    num_blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=gen)
    width = max(num_blocks_per_seq) + 1
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    keys, values, used = [], [], 0
    for seq_idx, seq_len in enumerate(seq_lens):
        blocks = order[used : used + num_blocks_per_seq[seq_idx]]
        used += len(blocks)
        block_tables[seq_idx, : len(blocks)] = blocks
        for dense, cache in ((keys, caches[0]), (values, caches[1])):
            rows = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[_slots(blocks, seq_len, block_size)] = rows
            dense.append(rows.float())
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu_seqlens_q = torch.tensor([0, *q_lens]).cumsum(0).int()
    tensors = (query, *caches, block_tables.int(), cu_seqlens_q, torch.tensor(seq_lens).int())
    return Batch(*(t.to(device) for t in tensors), keys, values)


def _slots(blocks, seq_len, block_size):
    """Flat cache rows (block_id * block_size + offset) of positions 0..seq_len-1."""
    positions = torch.arange(seq_len)
    return blocks[positions // block_size] * block_size + positions % block_size


def dense_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Plain causal softmax attention on contiguous fp64 K/V, one sequence at a time."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    query, starts = batch.query.cpu().double(), batch.cu_seqlens_q.tolist()
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    for seq_idx, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq, d]
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [heads, q_len, d]
        q_pos = torch.arange(len(keys) - (end - start), len(keys))
        future = torch.arange(len(keys))[None, :] > q_pos[:, None]
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(future, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def assert_close(name, actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    error = (actual - expected).abs()
    bad = error > atol + rtol * expected.abs()
    assert not bad.any(), (
        f"{name}: max abs error {error.max().item():.3g} at {bad.sum().item()} elements "
        f"(dtype {dtype}, atol {atol}, rtol {rtol})"
    )


def _run(case, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits=None):
    batch = make_batch(*case, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    args = batch.args(head_dim**-0.5)
    expected = paged_attention_ref(*args)
    out = paged_attention(*args, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close("out", out, expected, dtype)


# (head_dim, num_heads, num_kv_heads, block_size, dtype): GQA ratios 1, 4 and 7
CONFIGS = [
    (64, 2, 2, 16, torch.float32),
    (80, 8, 2, 8, torch.bfloat16),
    (128, 7, 1, 4, torch.float16),
    (80, 14, 2, 16, torch.float32),
    (128, 1, 1, 16, torch.bfloat16),
    (64, 4, 1, 4, torch.float16),
]


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "block_size", "dtype"), CONFIGS, ids=_id
)
def test_decode(head_dim, num_heads, num_kv_heads, block_size, dtype):
    _run(DECODE, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "block_size", "dtype"), CONFIGS, ids=_id
)
def test_mixed(head_dim, num_heads, num_kv_heads, block_size, dtype):
    _run(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    ("case", "head_dim", "num_heads", "num_kv_heads", "block_size", "dtype"),
    [
        (PREFILL, 80, 4, 1, 16, torch.bfloat16),
        (PREFILL, 64, 7, 1, 8, torch.float32),
        (CHUNKED, 128, 2, 2, 4, torch.float16),
        (CHUNKED, 80, 4, 1, 16, torch.float32),
    ],
    ids=_id,
)
def test_prefill(case, head_dim, num_heads, num_kv_heads, block_size, dtype):
    _run(case, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    ("case", "num_splits", "head_dim", "num_heads", "dtype"),
    [
        (DECODE, 3, 80, 4, torch.float32),  # 144-token tables: 3 partitions of 64
        (DECODE, 8, 128, 7, torch.bfloat16),  # more splits than key tiles: empty partitions
        (MIXED, 2, 64, 1, torch.float16),  # the kernel splits prefill chunks too when forced
    ],
    ids=_id,
)
def test_split_kv_forced(case, num_splits, head_dim, num_heads, dtype):
    _run(case, num_heads, 1, head_dim, 16, dtype, num_splits=num_splits)


def test_query_view_of_fused_qkv():
    """A strided query (slice of a qkv projection) gives the same result as a contiguous one."""
    batch = make_batch(*MIXED, 4, 2, 64, 8, torch.float32, "cpu")
    qkv = torch.cat([batch.query.flatten(1), torch.randn(batch.query.shape[0], 256)], dim=1)
    args = batch.args(0.125)
    out = paged_attention(qkv[:, :256].view(-1, 4, 64), *args[1:])
    assert_close("out", out, paged_attention_ref(*args), torch.float32)


def test_empty_batch():
    batch = make_batch([1], [3], 2, 1, 64, 4, torch.float32, "cpu")
    query = batch.query[:0]
    cu_seqlens_q = torch.zeros(1, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    args = (batch.key_cache, batch.value_cache, batch.block_tables[:0], cu_seqlens_q, empty)
    assert paged_attention(query, *args, 0.125, 0).shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("case", "num_heads", "num_kv_heads"),
    [(DECODE, 4, 4), (MIXED, 4, 1), (PREFILL, 7, 1), (CHUNKED, 8, 2)],
    ids=_id,
)
def test_reference_matches_dense(case, num_heads, num_kv_heads):
    batch = make_batch(*case, num_heads, num_kv_heads, 16, 4, torch.float32, "cpu")
    scale = 0.3
    out = paged_attention_ref(*batch.args(scale))
    assert_close("paged_attention_ref", out, dense_attention(batch, scale), torch.float32)


def test_choose_num_splits():
    # decode, 1 sequence, 8 KV heads, 32k context on 132 SMs: ~2 programs per SM
    assert choose_num_splits(1, 8, 1, 32768, 132) == 33
    assert choose_num_splits(64, 8, 1, 32768, 132) == 1  # enough programs already
    assert choose_num_splits(1, 8, 7, 32768, 132) == 1  # prefill in the batch
    assert choose_num_splits(1, 8, 1, 300, 132) == 1  # short context
    assert choose_num_splits(1, 1, 1, 10**6, 132) == 64  # capped


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [DECODE, MIXED, CHUNKED, LONG], ids=_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
def test_matches_reference_cuda(case, dtype):
    batch = make_batch(*case, 32, 8, 128, 16, dtype, "cuda")
    args = batch.args(128**-0.5)
    expected = paged_attention_ref(*args)
    for num_splits in (None, 1, 4):
        assert_close(
            f"out (num_splits={num_splits})",
            paged_attention(*args, num_splits=num_splits),
            expected,
            dtype,
        )
