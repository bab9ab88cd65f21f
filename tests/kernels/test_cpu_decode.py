"""The C decode-attention kernel (CPU backend) against its torch twin and dense attention."""

import pytest
import torch
from kvpager.kernels import cpu_decode
from kvpager.kernels.backend import check_backend_device, default_backend_name, get_kernel_ops
from kvpager.kernels.cpu_decode import (
    BF16_SDPA_MIN_CHUNK,
    SDPA_MIN_CHUNK,
    paged_attention_cpu,
    paged_decode,
)
from kvpager.kernels.reference import decode_attention_ref, paged_attention_ref
from kvpager.schemas.errors import ConfigError

from tests.kernels.test_paged_attention import (
    DECODE,
    MIXED,
    PREFILL,
    assert_close,
    dense_attention,
    make_batch,
)

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler here")

# (head_dim, num_heads, num_kv_heads, block_size, dtype): the literal-size paths (head_dim 64
# and 128, groups 1-8, SmolLM2's 64/9/3) and the runtime-size path (head_dim 8 and 80, group 9)
CONFIGS = [
    (64, 9, 3, 16, torch.float32),
    (128, 8, 1, 16, torch.float32),
    (64, 4, 4, 8, torch.bfloat16),
    (8, 4, 2, 8, torch.float32),
    (80, 18, 2, 16, torch.bfloat16),
    (64, 2, 2, 1, torch.float32),  # one token per block
]


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "block_size", "dtype"), CONFIGS)
def test_decode_matches_twin_and_dense(head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = make_batch(*DECODE, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    scale = head_dim**-0.5
    query = batch.query.float()
    out = paged_decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, scale
    )
    assert out is not None and out.dtype == torch.float32 and out.shape == query.shape
    twin = decode_attention_ref(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, scale
    )
    assert_close("vs twin", out, twin, torch.float32)
    # the dense reference reads the same (bf16-rounded) K/V in fp64, so fp32 tolerances hold
    assert_close("vs dense", out, dense_attention(batch, scale), torch.float32)


# decode rows, short chunks (the kernel, a row per token) and chunks of SDPA_MIN_CHUNK or more
# (SDPA) in one batch, one of them after cached context
SPLIT = ([1, 5, SDPA_MIN_CHUNK, 3, SDPA_MIN_CHUNK + 9], [40, 5, SDPA_MIN_CHUNK, 60, 300])
# a bf16 model's chunks of BF16_SDPA_MIN_CHUNK or more go to bf16 SDPA: fresh, and after context
BF16_SPLIT = (
    [1, BF16_SDPA_MIN_CHUNK - 1, BF16_SDPA_MIN_CHUNK, 40, 7],
    [30, BF16_SDPA_MIN_CHUNK - 1, 80, 300, 7],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [DECODE, MIXED, PREFILL, SPLIT, BF16_SPLIT])
def test_mixed_batches_equal_the_reference(case, dtype):
    """Decode rows and short prefill chunks run on the kernel (a row per query token, causal
    by its context), long chunks on SDPA: the twin's and dense attention's answer."""
    batch = make_batch(*case, 9, 3, 64, 16, dtype, "cpu")
    args = batch.args(0.125)
    out = paged_attention_cpu(*args)
    assert out.dtype == dtype
    assert_close("vs twin", out, paged_attention_ref(*args), dtype)
    assert_close("vs dense", out, dense_attention(batch, 0.125), dtype)


def test_unsupported_shapes_fall_back_to_the_twin():
    """head_dim not a multiple of 8: the kernel declines and the torch twin answers."""
    batch = make_batch(*DECODE, 2, 1, 12, 8, torch.float32, "cpu")
    args = batch.args(12**-0.5)
    assert paged_decode(*args[:4], batch.seq_lens, args[6]) is None
    assert_close("out", paged_attention_cpu(*args), paged_attention_ref(*args), torch.float32)


def test_table_padding_is_never_read():
    """Entries past each sequence's blocks hold ids far outside the cache."""
    batch = make_batch(*DECODE, 4, 2, 64, 8, torch.float32, "cpu")
    wide = torch.full((batch.block_tables.shape[0], 40), 10**6, dtype=torch.int32)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    scale = 0.125
    out = paged_decode(
        batch.query, batch.key_cache, batch.value_cache, wide[:, :-3], batch.seq_lens, scale
    )
    assert_close("out", out, dense_attention(batch, scale), torch.float32)


def test_cpu_is_the_default_backend_on_a_cpu_device():
    assert default_backend_name(torch.device("cpu")) == "cpu"
    assert default_backend_name(torch.device("cuda")) == "triton"
    assert get_kernel_ops("cpu").paged_attention is paged_attention_cpu


def test_the_c_kernels_refuse_a_cuda_device():
    check_backend_device("cpu", torch.device("cpu"))
    with pytest.raises(ConfigError, match="runs on a CPU device"):
        check_backend_device("cpu", torch.device("cuda"))


def test_loading_the_library_keeps_subnormal_floats():
    """Built with -ffast-math it would switch on flush-to-zero for the whole process."""
    assert cpu_decode.load() is not None
    tiny = torch.tensor(1e-40, dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def test_query_rows_may_be_apart():
    """q as a view into a wider qkv row (the decoder's layout) reads the same as a copy."""
    batch = make_batch(*DECODE, 9, 3, 64, 16, torch.float32, "cpu")
    wide = torch.randn(batch.query.shape[0], 15 * 64)
    wide[:, : 9 * 64] = batch.query.reshape(batch.query.shape[0], -1)
    view = wide[:, : 9 * 64].view(batch.query.shape)
    assert not view.is_contiguous()
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 0.125)
    assert torch.equal(paged_decode(view, *args), paged_decode(batch.query.contiguous(), *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    """A sequence alone (a task per kv head) and among many (its kv heads in one task, block
    by block) gives bitwise the same rows, and so does a window that starts mid-segment."""
    lens = [1, 16, 37, 130, 300, 257, 9, 64, 511, 2, 100, 40]  # segments of 256 split some
    batch = make_batch([1] * len(lens), lens, 9, 3, 64, 16, dtype, "cpu")
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 0.125)
    for window in (0, 200):
        together = paged_decode(batch.query, *args, window=window)
        for seq in range(len(lens)):
            alone = paged_decode(
                batch.query[seq : seq + 1], batch.key_cache, batch.value_cache,
                batch.block_tables[seq : seq + 1], batch.seq_lens[seq : seq + 1], 0.125,
                window=window,
            )  # fmt: skip
            assert torch.equal(alone, together[seq : seq + 1]), (window, seq)
        twin = decode_attention_ref(batch.query.float(), *args, window=window)
        assert_close("vs twin", together, twin, torch.float32)
