"""The CPU backend's per-layer C ops (kernels/cpu/layer_ops.c) against their torch twins."""

import functools
import platform

import pytest
import torch
from kvpager.engine.worker.host_malloc import retain_freed_memory
from kvpager.kernels import cpu_layer_ops
from kvpager.kernels.reference import (
    add_rms_norm_ref,
    gelu_tanh_and_mul_ref,
    reshape_and_cache_ref,
    rotary_ref,
    silu_and_mul_ref,
)

pytestmark = pytest.mark.skipif(cpu_layer_ops.load() is None, reason="no C compiler here")

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@pytest.fixture(params=["native", "x86-64-v3"])
def build(request, monkeypatch):
    """The library for the host (16 lanes where it has AVX-512) and for AVX2 (8 lanes): both
    widths' vector loops and scalar tails against the twins."""
    monkeypatch.setattr(cpu_layer_ops, "load", functools.partial(cpu_layer_ops.load, request.param))
    return request.param


def _qkv(num_tokens: int, head_dim: int = HEAD_DIM):
    """q, k, v as the decoder has them: views into one qkv matmul output."""
    sizes = [HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes))
    q, k, v = qkv.split(sizes, dim=-1)
    shape = (num_tokens, -1, head_dim)
    return qkv, q.view(shape), k.view(shape), v.view(shape)


def _cos_sin(num_tokens: int, head_dim: int = HEAD_DIM):
    angles = torch.rand(num_tokens, head_dim // 2) * 100
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_matches_twin_in_place_on_qkv_views(num_tokens, build):
    torch.manual_seed(num_tokens)
    qkv, q, k, v = _qkv(num_tokens)
    cos, sin = _cos_sin(num_tokens)
    want_q, want_k = rotary_ref(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    assert len(cpu_layer_ops._rotary_rows(q, k)) == 1  # q's and k's heads in one call
    got_q, got_k = cpu_layer_ops.rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, no copy
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before), "rotary wrote outside q and k"


def test_rotary_of_separate_q_and_k_matches_twin(build):
    """q and k in tensors of their own (after Qwen3's head norms): two calls, not one over
    both, and the same rows as the twin."""
    torch.manual_seed(3)
    _, q, k, _ = _qkv(9)
    q, k = q.clone(), k.clone()
    cos, sin = _cos_sin(9)
    want_q, want_k = rotary_ref(q.clone(), k.clone(), cos, sin)
    assert len(cpu_layer_ops._rotary_rows(q, k)) == 2
    got_q, got_k = cpu_layer_ops.rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)


def test_rotary_falls_back_to_the_twin_for_other_dtypes():
    _, q, k, _ = _qkv(5)
    q, k = q.double(), k.double()
    cos, sin = (t.double() for t in _cos_sin(5))
    want = rotary_ref(q, k, cos, sin)
    got = cpu_layer_ops.rotary(q.clone(), k.clone(), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden", [576, 13])
def test_add_rms_norm_matches_twin(with_delta, hidden, build):
    torch.manual_seed(hidden)
    residual = torch.randn(33, hidden) * 3
    delta = torch.randn(33, hidden) if with_delta else None
    weight = torch.randn(hidden)
    want_out, want_residual = add_rms_norm_ref(residual.clone(), delta, weight, 1e-5)
    got_out, got_residual = cpu_layer_ops.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)


def test_add_rms_norm_leaves_other_layouts_to_the_twin():
    """A transposed (non-contiguous) input goes to the twin and gives the twin's answer."""
    residual, weight = torch.randn(16, 8).t(), torch.randn(16)
    want = add_rms_norm_ref(residual, None, weight, 1e-6)
    got = cpu_layer_ops.add_rms_norm(residual, None, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_twin_exactly(cache_dtype):
    """Strided K/V views, padding slots skipped, caches compared whole (no stray writes);
    a bfloat16 cache takes the twin's path."""
    torch.manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 4, 11
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = (torch.randn(shape).to(cache_dtype) for _ in range(2))
    _, _, key, value = _qkv(num_tokens)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[1::3] = -1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    cpu_layer_ops.reshape_and_cache(key, value, key_cache, value_cache, slots.int())
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_malloc_settings_apply_on_glibc():
    assert retain_freed_memory() is True


@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_and_mul_matches_twin(inter, build):
    """Full vectors and the scalar tail; gates out to where exp over- and underflows."""
    torch.manual_seed(inter)
    gate_up = torch.randn(9, 2 * inter) * 4
    gate_up[0, :inter] = torch.linspace(-200, 200, inter)
    want = silu_and_mul_ref(gate_up)
    torch.testing.assert_close(cpu_layer_ops.silu_and_mul(gate_up), want, rtol=2e-6, atol=1e-6)


BF16_ULP = 2.0**-7  # relative spacing of bfloat16: one rounding apart at most


def test_write_kv_copies_bf16_rows_into_a_bf16_cache_exactly():
    """A bfloat16 model's K/V go to its cache as bytes: the whole cache equals the twin's."""
    torch.manual_seed(1)
    shape = (5, 4, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = (torch.randn(shape).bfloat16() for _ in range(2))
    _, _, key, value = _qkv(9)
    key, value = key.bfloat16(), value.bfloat16()
    slots = torch.randperm(20)[:9]
    slots[::4] = -1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, want_k, want_v, slots)
    cpu_layer_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_bf16_ops_equal_the_float32_twins_rounded_once(build):
    """bf16 tensors are widened as they load, computed in fp32 and rounded once as they are
    stored: the twins in fp32 on the same (widened) inputs, rounded to bf16, within one
    rounding."""
    torch.manual_seed(2)
    qkv = _qkv(13)[0].bfloat16()
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    q, k = (x.view(13, -1, HEAD_DIM) for x in qkv.split(sizes, dim=-1)[:2])
    cos, sin = (t.bfloat16() for t in _cos_sin(13))
    want = rotary_ref(q.float(), k.float(), cos.float(), sin.float())
    got = cpu_layer_ops.rotary(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and g.data_ptr() in (q.data_ptr(), k.data_ptr())
        torch.testing.assert_close(g.float(), w, rtol=BF16_ULP, atol=1e-6)
    residual, delta = (torch.randn(13, 576).bfloat16() for _ in range(2))
    weight = torch.randn(576).bfloat16()
    want_out, want_sum = add_rms_norm_ref(residual.float(), delta.float(), weight.float(), 1e-6)
    got_out, got_sum = cpu_layer_ops.add_rms_norm(residual, delta, weight, 1e-6)
    assert got_sum.data_ptr() == residual.data_ptr()  # summed in place, as in float32
    assert got_out.dtype == got_sum.dtype == torch.bfloat16
    assert torch.equal(got_sum, want_sum.bfloat16())  # the sum rounded once
    # the norm reads the stored (rounded) sum, as the bf16 twin does
    want_out = add_rms_norm_ref(want_sum.bfloat16().float(), None, weight.float(), 1e-6)[0]
    torch.testing.assert_close(got_out.float(), want_out, rtol=BF16_ULP, atol=1e-6)
    gate_up = (torch.randn(13, 2 * 96) * 4).bfloat16()
    got = cpu_layer_ops.silu_and_mul(gate_up)
    assert got.dtype == torch.bfloat16
    want = silu_and_mul_ref(gate_up.float())
    torch.testing.assert_close(got.float(), want, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden", [576, 13, 16])  # full vectors, and the scalar tail
def test_bf16_rows_with_a_float32_weight_scale_in_float32_as_the_twin(with_delta, hidden, build):
    """Gemma's (1 + w) kept in fp32: the C kernel's product is in fp32 and rounded once, the
    twin's too (transformers' Gemma norms), within the C sum's ~1e-7 (one rounding at most)."""
    torch.manual_seed(hidden)
    residual = (torch.randn(9, hidden) * 3).bfloat16()
    delta = torch.randn(9, hidden).bfloat16() if with_delta else None
    weight = 1.0 + 0.3 * torch.randn(hidden)  # not representable in bf16
    want_out, want_sum = add_rms_norm_ref(residual.clone(), delta, weight, 1e-6)
    got_out, got_sum = cpu_layer_ops.add_rms_norm(residual, delta, weight, 1e-6)
    assert got_sum.data_ptr() == residual.data_ptr()  # the C path, not the twin
    assert got_out.dtype == want_out.dtype == torch.bfloat16
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=BF16_ULP, atol=1e-6)
    assert (got_out != want_out).float().mean() < 0.01  # rounding-boundary cases only
    # the twin applies the weight in fp32: one rounding from the fp32 twin, bit for bit
    want_fp32 = add_rms_norm_ref(want_sum.float(), None, weight, 1e-6)[0]
    assert torch.equal(want_out, want_fp32.bfloat16())


@pytest.mark.parametrize("hidden", [16, 13])  # lanes of eight, and the scalar tail
def test_bf16_rounding_matches_torch_on_ties_and_special_values(hidden):
    """The residual sum is rounded as torch rounds float32 to bfloat16: ties to even, inf from
    overflow, NaN kept a NaN."""
    values = [1.0, 1.0078125, 3e38, float("inf"), float("nan"), -2.0, 1.0, 0.5]
    deltas = [2.0**-8, 2.0**-8, 3e38, 1.0, 1.0, -(2.0**-7), -(2.0**-9), 2.0**-10]
    residual = torch.tensor((values * 2)[:hidden]).bfloat16().repeat(3, 1)
    delta = torch.tensor((deltas * 2)[:hidden]).bfloat16().repeat(3, 1)
    want = (residual.float() + delta.float()).bfloat16()
    _, got = cpu_layer_ops.add_rms_norm(residual, delta, torch.ones(hidden).bfloat16(), 1e-6)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("inter", [13, 1536])
def test_bf16_silu_and_mul_lanes_and_tail(inter):
    torch.manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter) * 4).bfloat16()
    want = silu_and_mul_ref(gate_up.float())
    torch.testing.assert_close(
        cpu_layer_ops.silu_and_mul(gate_up).float(), want, rtol=BF16_ULP, atol=1e-6
    )


@pytest.mark.parametrize(
    "gated, twin",
    [
        (cpu_layer_ops.silu_and_mul, silu_and_mul_ref),
        (cpu_layer_ops.gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
    ],
)
def test_bf16_gates_at_extremes(gated, twin):
    """The bf16 gates past exp's clamp, near 0 and on a NaN: within a bf16 ulp of the float
    twin, and a NaN stays a NaN."""
    gate = torch.tensor([-200.0, -90.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 0.5, 20.0, 88.0, 90.0,
                         300.0, float("nan"), -3.0, 3.0, 1.0] * 2)  # fmt: skip
    up = torch.linspace(-2.0, 2.0, len(gate))
    gate_up = torch.cat([gate, up]).unsqueeze(0).bfloat16()
    got, want = gated(gate_up).float(), twin(gate_up.float())
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 20])  # 20: lanes and a scalar tail
@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],  # fmt: skip
)
def test_head_norms_read_qkv_views_in_place_as_rows_would(head_dim, dtype, weight_dtype, build):
    """q/k norms over heads still inside the qkv rows: the same values, bit for bit, as the
    row norm over the heads gathered into rows, and the twin's within rounding."""
    torch.manual_seed(head_dim)
    sizes = [HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    qkv = torch.randn(5, sum(sizes)).to(dtype)
    q, k, _ = (part.view(5, -1, head_dim) for part in qkv.split(sizes, dim=-1))
    weight = (torch.rand(head_dim) + 0.5).to(weight_dtype)
    for heads in (q, k):
        assert not heads.is_contiguous()
        got, residual = cpu_layer_ops.add_rms_norm(heads, None, weight, 1e-6)
        assert residual is heads and got.shape == heads.shape and got.is_contiguous()
        rows = heads.reshape(-1, head_dim).contiguous()
        assert torch.equal(
            got, cpu_layer_ops.add_rms_norm(rows, None, weight, 1e-6)[0].view(got.shape)
        )
        want = add_rms_norm_ref(heads, None, weight, 1e-6)[0]
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("inter", [1536, 37])
def test_gelu_tanh_and_mul_matches_twin(inter, build):
    """Gemma's GeGLU: full vectors and the scalar tail; gates out to where exp over- and
    underflows; bf16 rounded once from the same float32 values."""
    torch.manual_seed(inter)
    gate_up = torch.randn(9, 2 * inter) * 4
    gate_up[0, :inter] = torch.linspace(-200, 200, inter)
    want = gelu_tanh_and_mul_ref(gate_up)
    got = cpu_layer_ops.gelu_tanh_and_mul(gate_up)
    # atol: where torch's tanh has rounded to -1 (gates below about -4) the twin gives 0, the
    # kernel's g / (1 + exp(-2y)) the value itself, ~1e-7 of up
    torch.testing.assert_close(got, want, rtol=4e-6, atol=3e-6)
    narrow = gate_up.bfloat16()
    torch.testing.assert_close(
        cpu_layer_ops.gelu_tanh_and_mul(narrow).float(),
        gelu_tanh_and_mul_ref(narrow.float()),
        rtol=BF16_ULP,
        atol=3e-6,
    )
