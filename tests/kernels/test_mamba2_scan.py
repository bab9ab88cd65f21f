"""Mamba2's chunked scan (the prefill form) equals the token-by-token reference, from a zero
state and from a carried one, at chunk sizes that do and do not divide the length; the decode
step over several sequences equals each one's reference; the conv1d over split inputs equals
one pass; and the chunked scan equals transformers' torch SSD path (mamba2_chunk_scan)."""

import pytest
import torch
import torch.nn.functional as F
from kvpager.kernels.mamba2_scan import (
    causal_conv1d,
    ssm_scan_chunked,
    ssm_scan_sequential,
    ssm_step,
)

H, P, G, N = 4, 3, 2, 5


def inputs(num_tokens: int, seed: int = 0, head_dim: int = P, state_size: int = N):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, head_dim, generator=gen)
    dt = F.softplus(torch.randn(num_tokens, H, generator=gen))
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B = torch.randn(num_tokens, G, state_size, generator=gen)
    C = torch.randn(num_tokens, G, state_size, generator=gen)
    D = torch.randn(H, generator=gen)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("num_tokens,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (13, 64)])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_equals_sequential(num_tokens, chunk, carried):
    args = inputs(num_tokens)
    start = torch.randn(H, P, N) if carried else torch.zeros(H, P, N)
    ref_state, state = start.clone(), start.clone()
    ref = ssm_scan_sequential(*args, ref_state)
    out = ssm_scan_chunked(*args, state, chunk)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(state, start)


def test_chunked_in_pieces_equals_whole():
    """Chunked prefill: the state carried between pieces makes them one pass."""
    x, dt, A, B, C, D = inputs(11)
    whole_state, state = torch.zeros(H, P, N), torch.zeros(H, P, N)
    whole = ssm_scan_chunked(x, dt, A, B, C, D, whole_state, 4)
    pieces = [
        ssm_scan_chunked(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, state, 4)
        for s, e in [(0, 3), (3, 10), (10, 11)]
    ]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


def test_step_batches_sequences():
    seqs = [inputs(1, seed) for seed in range(3)]
    A, D = seqs[0][2], seqs[0][5]
    starts = torch.randn(3, H, P, N)
    refs, ref_states = [], starts.clone()
    for i, (x, dt, _, B, C, _) in enumerate(seqs):
        refs.append(ssm_scan_sequential(x, dt, A, B, C, D, ref_states[i])[0])
    states = starts.clone()
    out = ssm_step(
        torch.cat([s[0] for s in seqs]),
        torch.cat([s[1] for s in seqs]),
        A,
        torch.cat([s[3] for s in seqs]),
        torch.cat([s[4] for s in seqs]),
        D,
        states,
    )
    torch.testing.assert_close(out, torch.stack(refs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)


def test_conv1d_split_equals_whole():
    gen = torch.Generator().manual_seed(1)
    channels, kernel = 6, 4
    x = torch.randn(9, channels, generator=gen)
    weight, bias = (
        torch.randn(channels, kernel, generator=gen),
        torch.randn(channels, generator=gen),
    )
    whole_state, state = torch.zeros(channels, kernel - 1), torch.zeros(channels, kernel - 1)
    whole = causal_conv1d(x, whole_state, weight, bias)
    pieces = [causal_conv1d(x[s:e], state, weight, bias) for s, e in [(0, 2), (2, 3), (3, 9)]]
    torch.testing.assert_close(torch.cat(pieces), whole)
    torch.testing.assert_close(state, x[-3:].t())
    expected = F.silu(
        F.conv1d(x.t()[None], weight[:, None], bias, padding=kernel - 1, groups=channels)
    )
    torch.testing.assert_close(whole, expected[0, :, :9].t())


def test_chunked_equals_transformers():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    x, dt, A, B, C, D = inputs(13)
    start = torch.randn(H, P, N)
    state = start.clone()
    ours = ssm_scan_chunked(x, dt, A, B, C, D, state, 4)
    # transformers adds dt_bias and softplus itself: hand it the raw dt that gives ours
    raw_dt = torch.log(torch.expm1(dt))
    theirs, final = mamba2_chunk_scan(
        x[None],
        raw_dt[None],
        A,
        B[None],
        C[None],
        4,
        D=D,
        dt_bias=torch.zeros(H),
        initial_states=start[None],
        dt_softplus=True,
        return_final_states=True,
    )
    torch.testing.assert_close(ours, theirs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, final[0], rtol=1e-4, atol=1e-4)
