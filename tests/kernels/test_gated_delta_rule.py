"""The gated delta rule: the chunked prefill form equals the token-by-token twin from a zero
and from a carried state, at chunk sizes that do and do not divide the length, and in pieces
equals one pass; the decode step over several sequences equals each one's twin; the twin
equals transformers' torch recurrence and chunked form (Qwen3-Next's, grouped value heads);
the Triton varlen kernel (TRITON_INTERPRET=1 on CPU) equals the twin over a batch of prefill
chunks and decode tokens in state slots out of order, with awkward head sizes, and compiles
for CUDA (sm_90, in a child process without the interpreter: tests/kernels/test_cuda_compile.py
says why)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from kvpager.kernels.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    normalise_qk,
)
from kvpager.kernels.gated_delta_rule_ref import gated_delta_rule_ref, gated_delta_rule_varlen_ref

HK, H, K, V = 2, 4, 8, 6


def inputs(num_tokens: int, seed: int = 0, k_dim: int = K, v_dim: int = V):
    gen = torch.Generator().manual_seed(seed)
    q, k = normalise_qk(
        torch.randn(num_tokens, HK, k_dim, generator=gen),
        torch.randn(num_tokens, HK, k_dim, generator=gen),
    )
    v = torch.randn(num_tokens, H, v_dim, generator=gen)
    g = -F.softplus(torch.randn(num_tokens, H, generator=gen)) * 0.5
    beta = torch.rand(num_tokens, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("num_tokens,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (13, 64)])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_equals_twin(num_tokens, chunk, carried):
    args = inputs(num_tokens)
    start = torch.randn(H, K, V) if carried else torch.zeros(H, K, V)
    ref_state, state = start.clone(), start.clone()
    ref = gated_delta_rule_ref(*args, ref_state)
    out = gated_delta_rule_chunked(*args, state, chunk)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(state, start)


def test_chunked_in_pieces_equals_whole():
    q, k, v, g, beta = inputs(11, seed=1)
    whole_state, state = torch.zeros(H, K, V), torch.zeros(H, K, V)
    whole = gated_delta_rule_chunked(q, k, v, g, beta, whole_state, 4)
    pieces = [
        gated_delta_rule_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state, 4)
        for s, e in [(0, 3), (3, 10), (10, 11)]
    ]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


def test_step_batches_sequences():
    seqs = [inputs(1, seed) for seed in range(3)]
    starts = torch.randn(3, H, K, V)
    ref_states = starts.clone()
    refs = [gated_delta_rule_ref(*seq, ref_states[i])[0] for i, seq in enumerate(seqs)]
    states = starts.clone()
    out = gated_delta_rule_step(*(torch.cat(parts) for parts in zip(*seqs)), states)
    torch.testing.assert_close(out, torch.stack(refs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_twin_equals_transformers(form):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(3)
    raw_q, raw_k = torch.randn(13, HK, K, generator=gen), torch.randn(13, HK, K, generator=gen)
    _, _, v, g, beta = inputs(13, seed=3)
    start = torch.randn(H, K, V, generator=gen)
    state = start.clone()
    ours = gated_delta_rule_ref(*normalise_qk(raw_q, raw_k), v, g, beta, state)
    theirs_fn = getattr(hf, f"torch_{form}_gated_delta_rule")
    extra = {"chunk_size": 4} if form == "chunk" else {}
    theirs, final = theirs_fn(
        raw_q[None], raw_k[None], v[None], g=g[None], beta=beta[None], initial_state=start[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **extra,
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, final[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k_dim,v_dim", [(8, 6), (5, 40), (16, 64)])
def test_triton_varlen_equals_twin(k_dim, v_dim):
    pytest.importorskip("triton")
    from kvpager.kernels.gated_delta_rule_triton import gated_delta_rule_varlen

    lengths, slots = [5, 1, 9, 1], torch.tensor([3, 0, 4, 1])
    args = inputs(sum(lengths), seed=4, k_dim=k_dim, v_dim=v_dim)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    start = torch.randn(5, H, k_dim, v_dim)
    ref_states, states = start.clone(), start.clone()
    ref = gated_delta_rule_varlen_ref(*args, cu_seqlens, slots, ref_states)
    out = gated_delta_rule_varlen(*args, cu_seqlens, slots, states)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[2], start[2])  # the free slot untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_varlen_equals_twin_cuda():
    """Qwen3-Next's head shape (128 x 128 state, 2 value heads a key head) on the device:
    three prefill chunks and 61 decode tokens in one launch."""
    from kvpager.kernels.gated_delta_rule_triton import gated_delta_rule_varlen

    lengths = [300, 64, 7, *[1] * 61]
    gen = torch.Generator().manual_seed(5)
    total, heads, key_heads = sum(lengths), 8, 4
    q, k = normalise_qk(torch.randn(total, key_heads, 128, generator=gen),
                        torch.randn(total, key_heads, 128, generator=gen))  # fmt: skip
    v = torch.randn(total, heads, 128, generator=gen).bfloat16()
    g = -F.softplus(torch.randn(total, heads, generator=gen))
    beta = torch.rand(total, heads, generator=gen).bfloat16()
    args = [x.cuda() for x in (q, k, v, g, beta)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(80, generator=gen)[: len(lengths)]
    start = torch.randn(80, heads, 128, 128, generator=gen).cuda() * 0.1
    ref_states, states = start.clone(), start.clone()
    ref = gated_delta_rule_varlen_ref(*args, cu_seqlens, slots, ref_states)
    out = gated_delta_rule_varlen(*args, cu_seqlens.cuda(), slots.cuda(), states)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, ref_states, rtol=1e-4, atol=1e-4)


def _compile_for_cuda() -> None:
    import triton
    from kvpager.kernels import gated_delta_rule_triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.test_cuda_compile import _compile

    pointers = dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*bf16", g_ptr="*fp32")
    pointers.update(beta_ptr="*bf16", out_ptr="*fp32", state_ptr="*fp32")
    pointers.update(cu_seqlens_ptr="*i32", slots_ptr="*i64")
    const = dict(HEADS_PER_KEY=2, K=128, V=128, BLOCK_K=128, BLOCK_V=32)
    kernel = gated_delta_rule_triton._gated_delta_rule_kernel
    _compile(triton, ASTSource, kernel, pointers, const, GPUTarget("cuda", 90, 32))


def test_triton_kernel_compiles_for_cuda():
    pytest.importorskip("triton.backends.nvidia")
    from tests.kernels.test_cuda_compile import compile_in_child

    compile_in_child(__file__)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
    _compile_for_cuda()
