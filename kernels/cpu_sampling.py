"""Top-p filtering of float32 logits on C (kernels/cpu/nucleus.c), without sorting the
vocabulary; its twin is kernels/reference.py's top_k_top_p_ref (a row sorted whole). And the
inverse-CDF draw of each random row (`draw`), without a softmax or a cumsum of the whole row;
its twin is draw_ref.

Why: sorting every row's vocabulary was most of a top-p step's sampling on CPU; the kernel
sorts only the bucket the boundary falls in (the numbers: benchmarks/reports/
2026-12-03-saturated-step-profile/).
"""

import torch
from kvpager.kernels.cpu_build import I64, NATIVE, PTR, load_library

_SIGNATURES = (
    ("top_p_f32", (PTR, PTR, PTR, I64, I64, I64)),
    ("draw_f32", (PTR, PTR, PTR, PTR, I64, I64, I64)),
    ("draw_bf16", (PTR, PTR, PTR, PTR, I64, I64, I64)),
)
_DRAWS = {torch.float32: "draw_f32", torch.bfloat16: "draw_bf16"}


def load(march: str = NATIVE):
    """The compiled library (kernels/cpu/nucleus.c) for `march`, or None."""
    return load_library("nucleus", _SIGNATURES, march)


def top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """top_k_top_p_ref(logits, None, top_p) for rows whose top_p is in (0, 1): a new tensor, or
    None where the kernel does not take these inputs (not fp32 rows on the CPU, no compiler)."""
    library = load()
    fits = logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
    if library is None or not fits or not ((top_p > 0) & (top_p < 1)).all():
        return None
    logits = logits.contiguous()
    limits = top_p.to(torch.float32).contiguous()
    out = torch.empty_like(logits)
    rows, vocab = logits.shape
    status = library.top_p_f32(
        logits.data_ptr(), out.data_ptr(), limits.data_ptr(), rows, vocab, logits.stride(0)
    )
    return out if status == 0 else None


def draw(
    logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor
) -> torch.Tensor | None:
    """draw_ref(logits, inv_temperature, u): int64 [rows], the same tokens but where u falls
    within rounding of a boundary between two; None where the kernel does not take these
    inputs (not fp32 or bf16 rows on the CPU, no compiler, out of memory). bf16 logits are
    widened a row at a time in the kernel, not copied to float first."""
    library = load()
    fits = logits.dtype in _DRAWS and logits.device.type == "cpu" and logits.dim() == 2
    if library is None or not fits or logits.stride(1) != 1:
        return None
    rows, vocab = logits.shape
    inv_temperature = inv_temperature.to(torch.float32).contiguous()
    u = u.to(torch.float32).contiguous()
    if inv_temperature.shape != (rows,) or u.shape != (rows,):
        raise ValueError(f"inv_temperature {tuple(inv_temperature.shape)} and u "
                         f"{tuple(u.shape)} for {rows} rows")  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64)
    status = getattr(library, _DRAWS[logits.dtype])(
        logits.data_ptr(), inv_temperature.data_ptr(), u.data_ptr(), out.data_ptr(), rows,
        vocab, logits.stride(0),
    )  # fmt: skip
    return out if status == 0 else None
