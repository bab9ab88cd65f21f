"""Mamba2's Triton kernels (TRITON_INTERPRET=1 on CPU) equal their torch twins: the chunked
scan over a flat batch of prefill chunks of varied lengths (one token, shorter than a chunk,
across chunk edges) from carried states in slots out of order; the decode step over slots;
and the conv1d window roll (with and without bias, fp32 and bf16). A slot nobody holds stays
untouched. The kernels compile for CUDA (sm_90, in a child process without the interpreter:
tests/kernels/test_cuda_compile.py says why)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from kvpager.kernels.mamba2_scan import (
    causal_conv1d_step,
    ssm_scan_varlen_ref,
    ssm_step_slots_ref,
)

pytest.importorskip("triton")
H = 4  # tests/kernels/test_mamba2_scan.py's heads (its inputs imported in the tests: this
# file also runs as a script, the compile's child, before tests/ is on the path)
SLOTS = torch.tensor([3, 0, 4, 1])


@pytest.mark.parametrize("head_dim,state_size", [(3, 5), (40, 16)])
def test_scan_varlen_equals_twin(head_dim, state_size):
    from kvpager.kernels.mamba2_triton import ssm_scan_varlen

    from tests.kernels.test_mamba2_scan import inputs

    lengths = [37, 1, 16, 5]
    args = inputs(sum(lengths), 1, head_dim, state_size)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    start = torch.randn(5, H, head_dim, state_size)
    ref_states, states = start.clone(), start.clone()
    ref = ssm_scan_varlen_ref(*args, cu_seqlens, SLOTS, ref_states)
    out = ssm_scan_varlen(*args, cu_seqlens, SLOTS, states, chunk_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, ref_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], start[2])  # the free slot untouched


def test_step_slots_equals_twin():
    from kvpager.kernels.mamba2_triton import ssm_step_slots

    from tests.kernels.test_mamba2_scan import inputs

    args = inputs(4, 2, head_dim=40)
    start = torch.randn(5, H, 40, 5)
    ref_states, states = start.clone(), start.clone()
    ref = ssm_step_slots_ref(*args, ref_states, SLOTS)
    out = ssm_step_slots(*args, states, SLOTS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[2], start[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_step_equals_twin(dtype, with_bias):
    from kvpager.kernels.mamba2_triton import causal_conv1d_step_triton

    gen = torch.Generator().manual_seed(3)
    channels, kernel = 300, 4  # two channel blocks, the last one partial
    x = torch.randn(8, channels, generator=gen)[::2].to(dtype)  # rows not adjacent
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    start = torch.randn(5, channels, kernel - 1, generator=gen).to(dtype)
    ref_states, states = start.clone(), start.clone()
    ref = causal_conv1d_step(x, ref_states, SLOTS, weight, bias)
    out = causal_conv1d_step_triton(x, states, SLOTS, weight, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(states, ref_states)
    torch.testing.assert_close(states[2], start[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scan_and_step_equal_twins_cuda():
    """Mamba2's head shape (64 x 128 state, 8 heads a group) on the device: three prefill
    chunks in one scan launch, then 61 sequences' decode step from slots out of order."""
    from kvpager.kernels.mamba2_triton import ssm_scan_varlen, ssm_step_slots

    gen = torch.Generator().manual_seed(5)
    heads, groups, lengths = 16, 2, [300, 64, 7]
    total = sum(lengths)

    def tensors(num_tokens):
        x = torch.randn(num_tokens, heads, 64, generator=gen).bfloat16()
        dt = F.softplus(torch.randn(num_tokens, heads, generator=gen)) * 0.1
        B, C = (torch.randn(num_tokens, groups, 128, generator=gen).bfloat16() for _ in "BC")
        return [t.cuda() for t in (x, dt, B, C)]

    x, dt, B, C = tensors(total)
    A, D = (-torch.rand(heads, generator=gen)).cuda(), torch.randn(heads, generator=gen).cuda()
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(80, generator=gen)[:61]
    start = torch.randn(80, heads, 64, 128, generator=gen).cuda() * 0.1
    ref_states, states = start.clone(), start.clone()
    ref = ssm_scan_varlen_ref(x, dt, A, B, C, D, cu_seqlens, slots[:3], ref_states)
    out = ssm_scan_varlen(x, dt, A, B, C, D, cu_seqlens.cuda(), slots[:3].cuda(), states)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(states, ref_states, rtol=1e-3, atol=1e-3)
    x, dt, B, C = tensors(61)
    ref = ssm_step_slots_ref(x, dt, A, B, C, D, ref_states, slots.cuda())
    out = ssm_step_slots(x, dt, A, B, C, D, states, slots.cuda())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, ref_states, rtol=1e-3, atol=1e-3)


def _compile_for_cuda() -> None:
    import triton
    from kvpager.kernels import mamba2_triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.test_cuda_compile import _compile

    target = GPUTarget("cuda", 90, 32)
    # Mamba2's shapes (Granite 4 / Nemotron-H): head_dim 64, d_state 128, 8 heads a group
    pointers = dict(x_ptr="*bf16", dt_ptr="*fp32", a_ptr="*fp32", b_ptr="*bf16")
    pointers.update(c_ptr="*bf16", d_ptr="*fp32", out_ptr="*fp32", state_ptr="*fp32")
    pointers.update(cu_seqlens_ptr="*i32", slots_ptr="*i64")
    const = dict(HEADS_PER_GROUP=8, P=64, N=128, BLOCK_P=32, BLOCK_N=128)
    _compile(triton, ASTSource, mamba2_triton._ssm_step_kernel, pointers, const, target)
    const["CHUNK"] = mamba2_triton.CHUNK_SIZE
    _compile(triton, ASTSource, mamba2_triton._ssm_scan_kernel, pointers, const, target)
    pointers = dict(x_ptr="*bf16", weight_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16")
    pointers.update(state_ptr="*bf16", slots_ptr="*i64")
    const = dict(KERNEL=4, KERNEL_PAD=4, HAS_BIAS=True, BLOCK_C=256)
    _compile(triton, ASTSource, mamba2_triton._conv_step_kernel, pointers, const, target)


def test_triton_kernels_compile_for_cuda():
    pytest.importorskip("triton.backends.nvidia")
    from tests.kernels.test_cuda_compile import compile_in_child

    compile_in_child(__file__)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    _compile_for_cuda()
