"""Matmuls of the decoder: oneDNN with prepacked weights on CPU, `F.linear` elsewhere.

On CPU, `F.linear` goes to MKL's sgemm, which re-blocks the weight on every call. oneDNN's
linear takes a weight reordered once into its blocked layout, so the cost of blocking is paid
at load, not every step (benchmarks/reports/2026-11-29-cpu-2core-avx2/). The packed weight
lives in place of the checkpoint weight, which the decoder then releases.
"""

from collections.abc import Callable

import structlog
import torch
import torch.nn.functional as F
from kvpager.engine.memory import cpu_has_native_bf16
from torch import nn

log = structlog.get_logger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def onednn_packing_supported(weight: torch.Tensor) -> bool:
    """Float32 on a CPU build with oneDNN; bfloat16 too where oneDNN runs it natively
    (AVX-512-BF16 or AMX, where bf16 matmuls run at twice float32's width)."""
    native = weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and cpu_has_native_bf16()
    )
    return (
        weight.device.type == "cpu"
        and native
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True
) -> tuple[LinearFn, bool]:
    """x [tokens, in] -> [tokens, out], and whether `weight` was packed (then it is unused)."""
    if pack and onednn_packing_supported(weight):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        except RuntimeError as error:  # a build or CPU without the packed path
            log.warning("oneDNN weight packing unavailable, using F.linear", error=str(error))
        else:
            matmul = torch.ops.mkldnn._linear_pointwise
            return lambda x: matmul(x.contiguous(), packed, bias, "none", [], ""), True
    return lambda x: F.linear(x, weight, bias), False


def release(weight: nn.Parameter) -> None:
    """Drop a weight whose packed copy replaced it (keeps its dtype and device)."""
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
