"""The fp8 KV cache (e4m3 and e5m2): writes by the C and Triton kernels store exactly the twin's
bytes (x / scale, clamped, rounded to nearest even: torch's conversion), and attention over
fp8 blocks by the C kernel, the Triton kernel (TRITON_INTERPRET=1 on CPU) and the CPU backend's
prefill path matches the twin's dequantised attention, windows and soft-capping included. The
C kernels are also built for AVX2 (x86-64-v3, no AVX-512) and checked the same way."""

import functools

import pytest
import torch
from kvpager.kernels import block_ops, cpu_decode, cpu_layer_ops, kv_write, reference
from kvpager.kernels.cpu_decode import paged_attention_cpu
from kvpager.kernels.paged_attention import paged_attention
from kvpager.kernels.reference import FP8_DTYPES, paged_attention_ref, quantise_ref

from tests.kernels.test_paged_attention import CHUNKED, DECODE, MIXED, PREFILL, make_batch

FP8 = pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3", "e5m2"])
AVX2 = "x86-64-v3"
SCALES = (0.37, 1.6)  # k_scale, v_scale: neither 1, so a scale applied twice or not shows


def _awkward_rows(shape, dtype, seed):
    """Values over many binades, the formats' edges included: subnormals, ties, overflow."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
    flat = x.view(-1)
    edges = torch.tensor([1e30, -1e30, 0.0, -0.0, 448.0 * 0.37, 1e-7, 1.9642857, -31.25])
    flat[: len(edges)] = edges
    return x.to(dtype)


def _write_all(write, fp8, key_dtype):
    """Both caches after `write` of 50 tokens (one padding slot) into a garbage-filled cache."""
    key = _awkward_rows((50, 3, 20), key_dtype, 1)
    value = _awkward_rows((50, 3, 20), key_dtype, 2)
    cache = torch.randn(2, 10, 8, 3, 20, generator=torch.Generator().manual_seed(4)).to(fp8)
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(3))[:50]
    slots[7] = -1
    write(key, value, cache[0], cache[1], slots, k_scale=SCALES[0], v_scale=SCALES[1])
    return cache.view(torch.uint8)


@FP8
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("build", ["native", AVX2])
def test_c_write_stores_the_twins_bytes(fp8, key_dtype, build, monkeypatch):
    monkeypatch.setattr(cpu_layer_ops, "load", functools.partial(cpu_layer_ops.load, build))
    expected = _write_all(reference.reshape_and_cache_ref, fp8, key_dtype)
    assert torch.equal(_write_all(cpu_layer_ops.reshape_and_cache, fp8, key_dtype), expected)


@FP8
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_write_stores_the_twins_bytes(fp8, key_dtype):
    expected = _write_all(reference.reshape_and_cache_ref, fp8, key_dtype)
    assert torch.equal(_write_all(kv_write.reshape_and_cache, fp8, key_dtype), expected)


@FP8
def test_twin_write_is_torch_conversion_of_the_scaled_value(fp8):
    """Every code round-trips, and a value is stored as torch rounds x / scale."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = torch.isfinite(codes.float())
    stored = quantise_ref(codes.float()[finite] * 0.5, fp8, 0.5)
    assert torch.equal(stored.view(torch.uint8), codes[finite].view(torch.uint8))
    largest = torch.finfo(fp8).max
    big = quantise_ref(torch.tensor([1e9, -1e9]), fp8, 1.0).float()
    assert big.tolist() == [largest, -largest]  # clamped, never inf or NaN


def _fp8_batch(case, num_heads, num_kv_heads, head_dim, block_size, fp8, query_dtype):
    """A batch whose caches hold the fp8 codes of random K/V at SCALES."""
    batch = make_batch(*case, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu")
    batch.key_cache = quantise_ref(batch.key_cache * 2, fp8, SCALES[0])
    batch.value_cache = quantise_ref(batch.value_cache * 3, fp8, SCALES[1])
    batch.query = batch.query.to(query_dtype)
    return batch


def _attend(function, batch, **masking):
    return function(*batch.args(batch.query.shape[2] ** -0.5), **masking)


def _close(actual, expected, atol):
    """Within atol + atol * |expected| everywhere (relative too: V values reach ~15)."""
    error = (actual.float() - expected.float()).abs()
    bad = error > atol * (1 + expected.float().abs())
    assert not bad.any(), (
        f"max abs error {error.max().item():.3g} at {bad.sum().item()} (atol {atol})"
    )


# (case, head_dim, num_heads, num_kv_heads, block_size, masking)
ATTENTION = [
    (DECODE, 64, 4, 1, 16, {}),
    (DECODE, 128, 7, 1, 8, {"window": 20}),
    (MIXED, 64, 8, 2, 16, {"softcap": 30.0}),
    (PREFILL, 80, 4, 2, 16, {"window": 9, "softcap": 20.0}),
    (CHUNKED, 64, 2, 2, 4, {}),
]


@FP8
@pytest.mark.parametrize(
    ("case", "head_dim", "heads", "kv_heads", "block_size", "masking"), ATTENTION
)
def test_triton_attention_matches_the_twin(
    fp8, case, head_dim, heads, kv_heads, block_size, masking
):
    scales = dict(k_scale=SCALES[0], v_scale=SCALES[1], **masking)
    for query_dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        batch = _fp8_batch(case, heads, kv_heads, head_dim, block_size, fp8, query_dtype)
        expected = _attend(paged_attention_ref, batch, **scales)
        _close(_attend(paged_attention, batch, **scales), expected, atol)
    if case is DECODE:  # split-KV scales each partial
        _close(_attend(paged_attention, batch, num_splits=3, **scales), expected, atol)


@FP8
@pytest.mark.parametrize("build", ["native", AVX2])
@pytest.mark.parametrize(
    ("case", "head_dim", "heads", "kv_heads", "block_size", "masking"), ATTENTION
)
def test_c_attention_matches_the_twin(
    fp8, build, case, head_dim, heads, kv_heads, block_size, masking, monkeypatch
):
    """Decode rows and short prefill chunks on the C kernel, both builds."""
    monkeypatch.setattr(cpu_decode, "load", functools.partial(cpu_decode.load, build))
    scales = dict(k_scale=SCALES[0], v_scale=SCALES[1], **masking)
    batch = _fp8_batch(case, heads, kv_heads, head_dim, block_size, fp8, torch.bfloat16)
    args = batch.args(head_dim**-0.5)
    assert cpu_decode.paged_decode(args[0][:1], *args[1:4], args[5][:1], 0.1) is not None
    _close(
        _attend(paged_attention_cpu, batch, **scales),
        _attend(paged_attention_ref, batch, **scales),
        2e-2,
    )


@FP8
def test_long_prefill_dequantises_on_the_gather(fp8):
    """Long chunks take the C prefill kernel (widening each step's keys) where it fits, else
    the twin's SDPA over gathered blocks: equal to dense attention over the dequantised K/V."""
    batch = _fp8_batch(([1, 150], [40, 150]), 4, 2, 64, 16, fp8, torch.float32)
    scales = dict(k_scale=SCALES[0], v_scale=SCALES[1])
    dense = make_batch([1, 150], [40, 150], 4, 2, 64, 16, torch.float32, "cpu")
    dense.key_cache = batch.key_cache.float() * SCALES[0]
    dense.value_cache = batch.value_cache.float() * SCALES[1]
    _close(_attend(paged_attention_cpu, batch, **scales), _attend(paged_attention_ref, dense), 1e-4)


@FP8
@pytest.mark.parametrize("copy", [reference.copy_blocks_ref, block_ops.copy_blocks])
def test_block_copies_move_fp8_bytes(fp8, copy):
    cache = torch.randn(2, 2, 6, 4, 1, 8).to(fp8)
    before = cache.view(torch.uint8).clone()
    copy(cache, torch.tensor([[0, 3], [5, 1]]))
    after = cache.view(torch.uint8)
    assert torch.equal(after[:, :, [3, 1]], before[:, :, [0, 5]])
    assert torch.equal(after[:, :, [0, 2, 4, 5]], before[:, :, [0, 2, 4, 5]])


@FP8
@pytest.mark.parametrize("swap", [reference.swap_blocks_ref, block_ops.swap_blocks])
def test_block_swaps_move_fp8_bytes(fp8, swap):
    device_cache = torch.randn(2, 2, 6, 4, 1, 8).to(fp8)
    host_cache = torch.zeros(2, 2, 3, 4, 1, 8, dtype=fp8)
    swap(device_cache, host_cache, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(
        host_cache.view(torch.uint8)[:, :, [0, 2]], device_cache.view(torch.uint8)[:, :, [4, 1]]
    )
    swap(host_cache, device_cache, torch.tensor([[2, 5]]))
    assert torch.equal(
        device_cache.view(torch.uint8)[:, :, 5], device_cache.view(torch.uint8)[:, :, 1]
    )
