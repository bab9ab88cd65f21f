"""copy_blocks and swap_blocks against their twins, compared exactly over whole caches."""

import pytest
import torch
from kvpager.kernels.block_ops import copy_blocks, swap_blocks
from kvpager.kernels.reference import copy_blocks_ref, swap_blocks_ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cache(num_blocks, dtype=torch.bfloat16, head_dim=80, device="cpu"):
    """[num_layers=3, 2, num_blocks, block_size=4, num_kv_heads=2, head_dim]."""
    return torch.randn(3, 2, num_blocks, 4, 2, head_dim, device=device).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pairs", [[], [[5, 2]], [[1, 7], [6, 0], [9, 3]]])
def test_copy_blocks_matches_reference(dtype, pairs):
    torch.manual_seed(len(pairs))
    kv_cache = _cache(10, dtype)
    expected = kv_cache.clone()
    block_mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    copy_blocks_ref(expected, block_mapping)
    copy_blocks(kv_cache, block_mapping)
    assert torch.equal(kv_cache, expected), "kv_cache differs from the reference"


def test_copy_blocks_reference_copies_every_layer():
    kv_cache = _cache(4, torch.float32, head_dim=8)
    before = kv_cache.clone()
    copy_blocks_ref(kv_cache, torch.tensor([[3, 1]]))
    assert torch.equal(kv_cache[:, :, 1], before[:, :, 3])
    assert torch.equal(kv_cache[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]])


@pytest.mark.parametrize("pairs", [[], [[0, 4]], [[4, 0], [1, 3], [2, 1]]])
def test_swap_blocks_both_directions(pairs):
    """Device pool of 6 blocks <-> CPU pool of 5 blocks (both on the CPU here)."""
    torch.manual_seed(len(pairs))
    device_cache, cpu_cache = _cache(6), _cache(5)
    block_mapping = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    expected = cpu_cache.clone()
    swap_blocks_ref(device_cache, expected, block_mapping)
    swap_blocks(device_cache, cpu_cache, block_mapping)  # swap out
    assert torch.equal(cpu_cache, expected), "cpu_cache differs after swap out"
    swapped_in = block_mapping.flip(1)
    expected = device_cache.clone()
    cpu_cache[:, :, 0] += 1  # the pool changed meanwhile: swap in must read it
    swap_blocks_ref(cpu_cache, expected, swapped_in)
    swap_blocks(cpu_cache, device_cache, swapped_in)  # swap in
    assert torch.equal(device_cache, expected), "device_cache differs after swap in"


def test_swap_blocks_reference_moves_listed_blocks_only():
    src, dst = _cache(3, torch.float32, head_dim=8), _cache(2, torch.float32, head_dim=8)
    before = dst.clone()
    swap_blocks_ref(src, dst, torch.tensor([[2, 0]]))
    assert torch.equal(dst[:, :, 0], src[:, :, 2]) and torch.equal(dst[:, :, 1], before[:, :, 1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("to_cpu", [True, False])
def test_swap_blocks_cuda_cpu(to_cpu):
    torch.manual_seed(0)
    device_cache, cpu_cache = _cache(32, device="cuda"), _cache(16)
    block_mapping = torch.tensor([[7, 3], [0, 15], [31, 0]])
    src, dst = (device_cache, cpu_cache) if to_cpu else (cpu_cache, device_cache)
    if not to_cpu:
        block_mapping = block_mapping.flip(1)
    expected = dst.clone()
    swap_blocks_ref(src, expected, block_mapping)
    swap_blocks(src, dst, block_mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected), "destination cache differs from the reference"


@pytest.mark.gpu
@gpu
def test_copy_blocks_cuda():
    kv_cache = _cache(64, device="cuda")
    expected = kv_cache.clone()
    block_mapping = torch.tensor([[1, 40], [63, 2], [5, 6]], device="cuda")
    copy_blocks_ref(expected, block_mapping)
    copy_blocks(kv_cache, block_mapping)
    assert torch.equal(kv_cache, expected), "kv_cache differs from the reference"
