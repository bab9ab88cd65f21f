"""Mamba2's C decode step (kernels/cpu/mamba2_step.c) equals its torch twin
(ssm_step_slots_ref) over slots out of order, with a state size that leaves a tail past the
vector lanes, fp32 and bf16 states, built for the host and for AVX2 without AVX-512; a slot
nobody holds stays untouched, and slots outside the states are refused."""

import pytest
import torch
import torch.nn.functional as F
from kvpager.kernels import cpu_mamba2
from kvpager.kernels.mamba2_scan import ssm_step_slots_ref

S, H, P, G, N = 5, 4, 7, 2, 37
SLOTS = torch.tensor([8, 0, 3, 5, 1])


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, H, P, generator=gen)
    dt = F.softplus(torch.randn(S, H, generator=gen))
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B, C = torch.randn(S, G, N, generator=gen), torch.randn(S, G, N, generator=gen)
    return x, dt, A, B, C, torch.randn(H, generator=gen)


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_equals_twin(march, dtype):
    if cpu_mamba2.load(march) is None:
        pytest.skip(f"the C kernel does not build for {march} here")
    args = inputs()
    start = torch.randn(9, H, P, N).to(dtype)
    ref_states, states = start.clone(), start.clone()
    ref = ssm_step_slots_ref(*args, ref_states, SLOTS)
    out = cpu_mamba2.ssm_step_cpu(*args, states, SLOTS, march=march)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding, either side of a tie
    torch.testing.assert_close(states.float(), ref_states.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(states[[2, 4, 6, 7]], start[[2, 4, 6, 7]])


def test_slots_outside_the_states_are_refused():
    if cpu_mamba2.load() is None:
        pytest.skip("the C kernel does not build here")
    with pytest.raises(IndexError):
        cpu_mamba2.ssm_step_cpu(*inputs(), torch.zeros(9, H, P, N), torch.tensor([0, 9, 1, 2, 3]))
