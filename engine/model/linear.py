"""Matmuls of the decoder: oneDNN with prepacked weights on CPU, `F.linear` elsewhere.

On CPU, `F.linear` goes to MKL's sgemm, which re-blocks the weight on every call. oneDNN's
linear takes a weight reordered once into its blocked layout, so the cost of blocking is paid
at load, not every step (benchmarks/reports/2026-11-29-cpu-2core-avx2/). The packed weight
lives in place of the checkpoint weight, which the decoder then releases, unless plain
`F.linear` was timed faster at some row count (engine/model/linear_choice.py): then that row
count runs plain and both weights stay. `ONEDNN_VERBOSE=1` shows what runs: no weight reorder
after load, and the blocked weight (`AB16b64a2b` in bf16 on AVX512-BF16) on every call
(tests/engine/model/test_onednn_verbose.py).
"""

import structlog
import torch
import torch.nn.functional as F
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.linear_choice import (
    ALWAYS_PACKED,
    AMX_F32_ROWS,
    AMX_KERNEL_ROWS,
    AMX_NARROW_COLS,
    AMX_NARROW_ROWS,
    AMX_PASS_ROWS,
    AVX2_KERNEL_ROWS,
    AVX512_KERNEL_ROWS,
    KERNEL_OUT_ELEMENTS,
    KERNEL_ROWS,
    SMALL_ROWS,
    LinearFn,
    choose_linear,
    choose_small_kernel,
)
from kvpager.kernels import small_linear
from kvpager.kernels.isa import isa_flags
from torch import nn

log = structlog.get_logger(__name__)


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


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered once into oneDNN's blocked layout, or None where this build
    or CPU has no packed path. No batch-size hint: on AVX512-BF16 the hint inductor passes
    (64) gave the same `AB16b64a2b` layout for every SmolLM2 shape
    (docs/design/packed-linears.md)."""
    if not onednn_packing_supported(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError as error:  # a build or CPU without the packed path
        log.warning("oneDNN weight packing unavailable, using F.linear", error=str(error))
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [tokens, in] @ packed.T (+ bias) -> [tokens, out], reading the weight as packed."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True, measure: bool = False
) -> tuple[LinearFn, bool]:
    """x [tokens, in] -> [tokens, out], and whether `weight` is unused (then the caller may
    release it). With `measure`, plain and packed are timed once per shape
    (engine/model/linear_choice.py) and each row count runs the faster; where both win at
    some row count both weights stay. Without it (the default) a packable weight always runs
    packed: a choice by timing can differ between two processes on one host, and with it the
    last ulps of the logits, so greedy outputs near a tie would change from run to run."""
    packed = pack_weight(weight) if pack else None

    def plain_fn(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias)

    if packed is None:
        blocked = bf16_blocks_linear(weight, bias) if pack else None
        return (blocked, True) if blocked is not None else (plain_fn, False)

    def onednn_fn(x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, packed, bias)

    packed_fn = with_f32_tiles(
        weight, bias, with_small_kernel(weight, packed, bias, onednn_fn, measure)
    )
    choice = choose_linear(weight, bias, plain_fn, packed_fn) if measure else ALWAYS_PACKED
    if not choice.mixed:
        return (packed_fn, True) if choice.packed_small else (plain_fn, False)
    small_fn, large_fn = (packed_fn, plain_fn) if choice.packed_small else (plain_fn, packed_fn)
    return lambda x: small_fn(x) if x.shape[0] <= SMALL_ROWS else large_fn(x), False


# the ISA flag a dtype's kernel needs to pay, and the rows it takes there
# (docs/design/packed-linears.md): vdpbf16ps for bf16, AVX-512 FMAs for fp32, up to
# AVX512_KERNEL_ROWS; fp32's AVX2 build (kernels/cpu/small_linear_avx2.h) up to
# AVX2_KERNEL_ROWS, and fewer where the output would be large (an lm_head's 64 rows, 49152
# wide, wrote slower than oneDNN's). Without the ISA it still runs (tests) but is only taken
# when timed.
_KERNEL_ISA = {
    torch.bfloat16: (("avx512_bf16", AVX512_KERNEL_ROWS),),
    torch.float32: (("avx512f", AVX512_KERNEL_ROWS), ("avx2", AVX2_KERNEL_ROWS)),
}
# False turns the small-row kernel off in every built linear, read at call time (the A/B
# benchmark, benchmarks/engine/small_linear_ab.py); F32_TILES_ON the same for fp32 on tiles
KERNEL_ON = True
F32_TILES_ON = True


def kernel_rows(weight: torch.Tensor, isa: list[str] | None = None, amx: bool = False) -> int:
    """Rows up to which the small-row kernel runs `weight` on this host's ISA (0: it does not
    pay here, so only timing would take it); `amx`: oneDNN packed it for the tile unit."""
    if amx:
        if weight.shape[0] <= AMX_NARROW_COLS:
            return AMX_NARROW_ROWS
        wide = weight.shape[0] * AMX_KERNEL_ROWS > KERNEL_OUT_ELEMENTS
        return AMX_PASS_ROWS if wide else AMX_KERNEL_ROWS
    flags = isa_flags() if isa is None else isa
    for flag, rows in _KERNEL_ISA.get(weight.dtype, ()):
        if flag in flags:
            return min(rows, KERNEL_OUT_ELEMENTS // weight.shape[0])
    return 0


def view_rows(weight: torch.Tensor, view: small_linear.PackedView) -> int:
    """Rows up to which the kernel over `view` runs `weight`: the tile unit's where oneDNN
    packed it for AMX, else the host ISA's (KERNEL_ROWS where only timing would take it)."""
    return kernel_rows(weight, amx=view.cols == small_linear.AMX_COLS) or KERNEL_ROWS


def with_small_kernel(
    weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, onednn: LinearFn,
    measure: bool,
) -> LinearFn:  # fmt: skip
    """`onednn`, with small row counts on the C kernel that reads the same packed buffer
    (kernels/small_linear.py): where the host has the ISA it pays on (or, with `measure`,
    where it was timed faster) and oneDNN's layout is one it reads (on AMX hosts, bf16 on the
    tile unit). No second copy."""
    # (an AMX host has AVX512-BF16, so kernel_rows is not 0 there either)
    view = small_linear.view_packed(weight, packed) if kernel_rows(weight) or measure else None
    if view is None or not small_linear.runs(view):
        return onednn
    rows = view_rows(weight, view)
    mixed_bias = bias is not None and bias.dtype != weight.dtype

    def kernel_fn(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != view.dtype or mixed_bias:  # oneDNN takes these
            return onednn(x)
        return small_linear.small_linear(x, view, bias)

    if measure and not choose_small_kernel(weight, onednn, kernel_fn):
        return onednn
    return lambda x: kernel_fn(x) if KERNEL_ON and x.shape[0] <= rows else onednn(x)


def with_f32_tiles(weight: torch.Tensor, bias: torch.Tensor | None, fewer: LinearFn) -> LinearFn:
    """An fp32 weight on an AMX host: from AMX_F32_ROWS rows on the tile unit, over the weight
    split once into three bf16 parts (kernels/small_linear.py's split_planes: 6 bytes a weight
    beside oneDNN's 4, which `fewer` keeps for fewer rows, where reading it is the cost). As
    exact as fp32's own matmul: its error against float64 is the same size
    (tests/kernels/test_amx_linear_f32.py). `fewer` everywhere else."""
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return fewer
    planes = small_linear.split_planes(weight)
    if planes is None:
        return fewer

    def tiles_fn(x: torch.Tensor) -> torch.Tensor:
        if F32_TILES_ON and x.dim() == 2 and x.dtype == torch.float32 and len(x) >= AMX_F32_ROWS:
            return small_linear.tile_linear_f32(x, planes, bias)
        return fewer(x)

    return tiles_fn


def bf16_blocks_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """A bf16 weight on an AVX2 host where oneDNN has no native bf16 (so packs none, and its
    bf16 matmul ran ~4x slower than fp32's): the C kernel over the weight blocked once at load
    (kernels/small_linear.py's block_bf16), for every row count; rows past the output cap run
    in slices. None elsewhere (then F.linear)."""
    if (
        weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or cpu_has_native_bf16()
        or "avx2" not in isa_flags()
    ):
        return None
    blocked = small_linear.block_bf16(weight)
    if blocked is None:
        return None
    out_features = weight.shape[0]  # the plain weight is released once this is built
    rows = max(1, KERNEL_OUT_ELEMENTS // out_features)

    def blocked_fn(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        parts = [small_linear.small_linear_bf16w(part, blocked, bias) for part in flat.split(rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], out_features)

    return blocked_fn


def release(weight: nn.Parameter) -> None:
    """Drop a weight whose packed copy replaced it (keeps its dtype and device)."""
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def build_matmul(weight: nn.Parameter, bias: torch.Tensor | None, pack: bool) -> LinearFn:
    """The weight's matmul (make_linear); once packed, the plain weight (a copy) is released."""
    matmul, packed = make_linear(weight, bias, pack)
    if packed:
        release(weight)
    return matmul


def param_makers(dtype: torch.dtype):
    """param(*shape): an uninitialised weight the loader fills; optional(on, *shape): the
    same, or None where the family has no such weight."""

    def param(*shape: int, dtype: torch.dtype = dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

    def optional(on: bool, *shape: int, dtype: torch.dtype = dtype) -> nn.Parameter | None:
        return param(*shape, dtype=dtype) if on else None

    return param, optional
