"""Mamba2's decode step on the CPU (kernels/cpu/mamba2_step.c): the SSM state update of a
batch of sequences, each on its own slot, in place, with the twin's contract
(kernels/mamba2_scan.py: ssm_step_slots_ref), and the twin where the kernel declines (no C
compiler, CUDA tensors, a state dtype other than fp32 / bf16). The mixer calls it for its
decode tokens on CPU (engine/model/mamba2.py); tests/kernels/test_cpu_mamba2.py checks it
against the twin and times the two.
"""

import torch
from kvpager.kernels.cpu_build import I64, NATIVE, PTR, load_library
from kvpager.kernels.mamba2_scan import ssm_step_slots_ref

_FUNCTIONS = {torch.float32: "mamba2_step_f32", torch.bfloat16: "mamba2_step_bf16"}
_ARGTYPES = (PTR,) * 9 + (I64,) * 6
_SIGNATURES = tuple((name, _ARGTYPES) for name in _FUNCTIONS.values())


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/mamba2_step.c) for `march`, or None."""
    return load_library("mamba2_step", _SIGNATURES, march)


def _declines(x: torch.Tensor, states: torch.Tensor) -> bool:
    return x.device.type != "cpu" or states.dtype not in _FUNCTIONS or not states.is_contiguous()


def ssm_step_cpu(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    march: str = NATIVE,
) -> torch.Tensor:
    """x [S, H, P], dt [S, H], A, D [H], B, C [S, G, N]; sequence i on states[slots[i]]
    ([slots, H, P, N], updated in place). Returns y [S, H, P] float32."""
    library = None if _declines(x, states) else load(march)
    if library is None:
        return ssm_step_slots_ref(x, dt, A, B, C, D, states, slots)
    num_seqs, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    assert states.shape[1:] == (heads, head_dim, state_size), "state shape"
    assert heads % groups == 0, "heads must be a multiple of groups"
    index = slots.to(torch.int64).contiguous()
    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < states.shape[0]:
        raise IndexError(f"state slots {index.tolist()} outside 0..{states.shape[0] - 1}")
    inputs = [t.float().contiguous() for t in (x, dt, A, B, C, D)]
    out = torch.empty(num_seqs, heads, head_dim, dtype=torch.float32)
    getattr(library, _FUNCTIONS[states.dtype])(
        *(t.data_ptr() for t in inputs), states.data_ptr(), index.data_ptr(), out.data_ptr(),
        num_seqs, heads, groups, head_dim, state_size, torch.get_num_threads(),
    )  # fmt: skip
    return out
