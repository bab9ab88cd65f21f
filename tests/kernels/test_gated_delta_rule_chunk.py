"""The gated delta rule's chunked Triton kernel (TRITON_INTERPRET=1 on CPU) equals the
token-by-token twin over a flat batch of prefill chunks of varied lengths (one token, shorter
than a chunk, across chunk edges) from carried states in slots out of order, with awkward head
sizes, for all sequences or a chosen few; a slot nobody holds stays untouched. It compiles for
CUDA (sm_90, in a child process without the interpreter: tests/kernels/test_cuda_compile.py
says why)."""

import sys

import pytest
import torch
from kvpager.kernels.gated_delta_rule_ref import gated_delta_rule_varlen_ref

pytest.importorskip("triton")
H = 4  # tests/kernels/test_gated_delta_rule.py's value heads (imported there, not here: this
# file also runs as a script, the compile's child, before tests/ is on the path)
LENGTHS, SLOTS = [37, 1, 16, 5], torch.tensor([3, 0, 4, 1])


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("k_dim,v_dim", [(8, 6), (5, 40)])
def test_chunked_kernel_equals_twin(k_dim, v_dim):
    from kvpager.kernels.gated_delta_rule_chunk_triton import chunk_gated_delta_rule_varlen

    from tests.kernels.test_gated_delta_rule import inputs

    args = inputs(sum(LENGTHS), seed=6, k_dim=k_dim, v_dim=v_dim)
    start = torch.randn(5, H, k_dim, v_dim)
    ref_states, states = start.clone(), start.clone()
    ref = gated_delta_rule_varlen_ref(*args, cu_seqlens(LENGTHS), SLOTS, ref_states)
    out = chunk_gated_delta_rule_varlen(*args, cu_seqlens(LENGTHS), SLOTS, states, chunk_size=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, ref_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], start[2])  # the free slot untouched


def test_chosen_sequences_only():
    """The mixer runs prefill chunks here and decode tokens on the step kernel."""
    from kvpager.kernels.gated_delta_rule_chunk_triton import chunk_gated_delta_rule_varlen

    from tests.kernels.test_gated_delta_rule import inputs

    args = inputs(sum(LENGTHS), seed=7)
    start = torch.randn(5, H, 8, 6)
    ref_states, states = start.clone(), start.clone()
    ref = gated_delta_rule_varlen_ref(*args, cu_seqlens(LENGTHS), SLOTS, ref_states)
    chosen = torch.tensor([0, 3])
    out = chunk_gated_delta_rule_varlen(
        *args, cu_seqlens(LENGTHS), SLOTS, states, seq_ids=chosen, chunk_size=16
    )
    rows = [*range(0, 37), *range(54, 59)]
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[[3, 1]], ref_states[[3, 1]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[[0, 2, 4]], start[[0, 2, 4]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_kernel_equals_twin_cuda():
    """Qwen3-Next's head shape (128 x 128 state, 2 value heads a key head) on the device:
    three prefill chunks from slots out of order."""
    import torch.nn.functional as F
    from kvpager.kernels.gated_delta_rule import normalise_qk
    from kvpager.kernels.gated_delta_rule_chunk_triton import chunk_gated_delta_rule_varlen

    lengths, heads, key_heads = [300, 64, 7], 8, 4
    gen = torch.Generator().manual_seed(5)
    total = sum(lengths)
    q, k = normalise_qk(torch.randn(total, key_heads, 128, generator=gen),
                        torch.randn(total, key_heads, 128, generator=gen))  # fmt: skip
    v = torch.randn(total, heads, 128, generator=gen).bfloat16()
    g = -F.softplus(torch.randn(total, heads, generator=gen))
    beta = torch.rand(total, heads, generator=gen).bfloat16()
    args = [x.cuda() for x in (q, k, v, g, beta)]
    slots = torch.randperm(80, generator=gen)[:3]
    start = torch.randn(80, heads, 128, 128, generator=gen).cuda() * 0.1
    ref_states, states = start.clone(), start.clone()
    ref = gated_delta_rule_varlen_ref(*args, cu_seqlens(lengths), slots, ref_states)
    out = chunk_gated_delta_rule_varlen(*args, cu_seqlens(lengths).cuda(), slots.cuda(), states)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(states, ref_states, rtol=1e-3, atol=1e-3)


def _compile_for_cuda() -> None:
    import triton
    from kvpager.kernels import gated_delta_rule_chunk_triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.test_cuda_compile import _compile

    pointers = dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*bf16", g_ptr="*fp32")
    pointers.update(beta_ptr="*bf16", out_ptr="*fp32", state_ptr="*fp32")
    pointers.update(cu_seqlens_ptr="*i32", slots_ptr="*i64", seq_ids_ptr="*i64")
    # Qwen3-Next's head shape: a 128 x 128 state, 2 value heads a key head
    chunk = gated_delta_rule_chunk_triton.CHUNK_SIZE
    const = dict(HEADS_PER_KEY=2, K=128, V=128, CHUNK=chunk, BLOCK_K=128, BLOCK_V=32)
    kernel = gated_delta_rule_chunk_triton._chunk_gated_delta_rule_kernel
    _compile(triton, ASTSource, kernel, pointers, const, GPUTarget("cuda", 90, 32))


def test_chunked_kernel_compiles_for_cuda():
    pytest.importorskip("triton.backends.nvidia")
    from tests.kernels.test_cuda_compile import compile_in_child

    compile_in_child(__file__)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    _compile_for_cuda()
