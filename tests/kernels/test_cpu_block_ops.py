"""swap_blocks_cpu (runs of copies: the C kernel kernels/cpu/block_copy.c, or torch slice
copies without it) and copy_block_in against the twin, byte for byte over whole caches."""

import pytest
import torch
from kvpager.kernels import cpu_block_ops
from kvpager.kernels.cpu_block_ops import block_runs, copy_block_in, swap_blocks_cpu
from kvpager.kernels.reference import swap_blocks_ref


@pytest.fixture(autouse=True, params=["c", "torch"])
def kernel(request, monkeypatch):
    """Every test runs on the C kernel and on the torch copies it stands in for."""
    if request.param == "c":
        library = cpu_block_ops.load()
        if library is None:
            pytest.skip("no C compiler here")
        monkeypatch.setattr(cpu_block_ops, "load", lambda march=None: library)
    else:
        monkeypatch.setattr(cpu_block_ops, "load", lambda march=None: None)
    return request.param


PAIRS = [
    [],
    [[3, 1]],
    [[0, 4], [1, 5], [2, 6]],  # one run
    [[7, 2], [0, 4], [1, 5], [9, 0], [2, 6], [8, 3]],  # shuffled: two runs and a single
    [[5, 1], [4, 2], [3, 3]],  # src going down: no run
]


def _cache(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[num_layers=3, 2, num_blocks, block_size=4, num_kv_heads=2, head_dim=8]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, 4, 2, 8, generator=generator).to(dtype)


def test_block_runs_join_consecutive_pairs_in_destination_order():
    mapping = torch.tensor(PAIRS[3])
    assert block_runs(mapping) == [(9, 0, 1), (7, 2, 2), (0, 4, 3)]
    assert block_runs(torch.tensor(PAIRS[4])) == [(5, 1, 1), (4, 2, 1), (3, 3, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("pairs", PAIRS)
def test_swap_blocks_cpu_equals_the_per_block_twin_byte_for_byte(dtype, pairs):
    src, dst = _cache(10, dtype, 1), _cache(8, dtype, 2)
    expected = dst.clone()
    mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    swap_blocks_ref(src, expected, mapping)
    swap_blocks_cpu(src, dst, mapping)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    for src_block, dst_block in pairs:  # and the twin really moved them, layer by layer
        assert torch.equal(
            dst[:, :, dst_block].view(torch.uint8), src[:, :, src_block].view(torch.uint8)
        )


def test_swap_blocks_cpu_refuses_a_cache_it_cannot_view():
    src = _cache(4, torch.float32, 0).transpose(3, 4)  # not contiguous: a copy would be written
    with pytest.raises(AssertionError, match="contiguous"):
        swap_blocks_cpu(src, _cache(4, torch.float32, 1), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_block_in_lands_one_block_byte_for_byte(dtype):
    cache = _cache(6, dtype, 3)
    block = _cache(1, dtype, 4)[:, :, 0]
    expected = cache.clone()
    expected[:, :, 4] = block
    copy_block_in(block.contiguous(), cache, 4)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    strided = _cache(3, dtype, 5)[:, :, 1]  # a snapshot's slice: not contiguous
    copy_block_in(strided, cache, 0)
    assert torch.equal(cache[:, :, 0].view(torch.uint8), strided.contiguous().view(torch.uint8))
    with pytest.raises(AssertionError, match="past the end"):
        copy_block_in(block.contiguous(), cache, 6)
    with pytest.raises(AssertionError, match="negative"):
        copy_block_in(block.contiguous(), cache, -1)


def test_swap_blocks_cpu_refuses_a_block_past_either_cache():
    src, dst = _cache(4, torch.float32, 0), _cache(3, torch.float32, 1)
    for pairs in ([[4, 0]], [[0, 3]], [[1, 0], [2, 1], [3, 2], [0, 3]]):
        with pytest.raises(AssertionError, match="past the end"):
            swap_blocks_cpu(src, dst, torch.tensor(pairs))
