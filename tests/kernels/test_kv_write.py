"""reshape_and_cache against its twin: whole caches must match exactly (no stray writes)."""

import pytest
import torch
from kvpager.kernels.kv_write import reshape_and_cache
from kvpager.kernels.reference import reshape_and_cache_ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device="cpu"):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _check(key, value, key_cache, value_cache, slot_mapping):
    """Run kernel and twin on copies of the same caches and compare them whole."""
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, expected_k, expected_v, slot_mapping)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k), "key_cache differs from the reference"
    assert torch.equal(value_cache, expected_v), "value_cache differs from the reference"


@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_kv_heads", "block_size"),
    [
        (torch.float32, 64, 1, 16),
        (torch.bfloat16, 80, 2, 4),
        (torch.float16, 128, 3, 8),
    ],
)
@pytest.mark.parametrize("num_tokens", [1, 11])
def test_matches_reference(dtype, head_dim, num_kv_heads, block_size, num_tokens):
    torch.manual_seed(num_tokens)
    num_blocks = 6
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[1::3] = -1  # padding tokens are skipped
    _check(key, value, key_cache, value_cache, slot_mapping)


def test_all_padding_writes_nothing():
    key_cache, value_cache = _caches(3, 4, 2, 64, torch.float32)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key = value = torch.randn(5, 2, 64)
    reshape_and_cache(key, value, key_cache, value_cache, torch.full((5,), -1))
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_fused_qkv_views_int32_slots_and_cast():
    """K/V as strided views into one qkv projection, int32 slots, fp32 rows into fp16."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 80, 6
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    _, key, value = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    key_cache, value_cache = _caches(4, 4, num_kv_heads, head_dim, torch.float16)
    slot_mapping = torch.tensor([15, 0, -1, 7, 8, 3], dtype=torch.int32)
    _check(key, value, key_cache, value_cache, slot_mapping)


def test_reference_writes_each_slot():
    """The twin itself: row t lands at [slot // block_size, slot % block_size], nothing else."""
    key_cache, value_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reshape_and_cache_ref(key, value, key_cache, value_cache, torch.tensor([9, -1, 2]))
    expected = torch.zeros(3, 4, 2, 8)
    expected[2, 1], expected[0, 2] = key[0], key[2]
    assert torch.equal(key_cache, expected)
    expected[2, 1], expected[0, 2] = value[0], value[2]
    assert torch.equal(value_cache, expected)


@pytest.mark.gpu
@gpu
def test_matches_reference_cuda():
    torch.manual_seed(0)
    key_cache, value_cache = _caches(64, 16, 8, 128, torch.bfloat16, device="cuda")
    key = torch.randn(100, 8, 128, device="cuda").bfloat16()
    value = torch.randn(100, 8, 128, device="cuda").bfloat16()
    slot_mapping = torch.randperm(64 * 16, device="cuda")[:100]
    slot_mapping[::7] = -1
    _check(key, value, key_cache, value_cache, slot_mapping)
