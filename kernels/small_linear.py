"""Decode-sized linears on C (kernels/cpu/small_linear.c), reading the weight oneDNN packed at
load in place: no second copy. Its twin is kernels/reference.py's `small_linear_ref`.

Where oneDNN has no native bf16 (AVX2 hosts) it packs no bf16 weight, so `block_bf16` lays one
out in its fp32 block order, [N/64][K][64] (a copy, made once at load), and
`small_linear_bf16w` runs rows of any count over it: fp32 sums of the widened bf16 products,
rounded once to bf16, as oneDNN's bf16 matmul computes them.

`view_packed` checks, once per weight, that oneDNN's buffer is in a layout the C code reads
(AB16b64a2b in bf16, AB16b64a in fp32: what oneDNN chose on AVX-512 hosts; AB16b32a2b in bf16
on AMX hosts, which kernels/cpu/amx_linear.c runs on the tile unit) by comparing its first and
last column blocks with the same reorder done in torch; a host, shape or version with another
layout gets None and keeps oneDNN's matmul. The engine runs it for small row counts only
(engine/model/linear.py); docs/design/packed-linears.md has why and the timings.
"""

import ctypes
import functools
from dataclasses import dataclass

import torch
from kvpager.kernels.cpu_build import I64, NATIVE, PTR, load_library

COLS = 64  # output columns of a packed block
AMX_COLS = 32  # ... in the layout oneDNN packs bf16 in on AMX hosts (AB16b32a2b)
K_ALIGN = {torch.bfloat16: 32, torch.float32: 16}
_ARGS = (PTR, I64, I64, PTR, I64, PTR, PTR, I64)
_SIGNATURES = (
    ("small_linear_bf16", _ARGS),
    ("small_linear_f32", _ARGS),
    ("small_linear_bf16w", _ARGS),
)
_AMX_SIGNATURES = (("tiles_ready", ()), ("amx_linear_bf16", _ARGS))
_AMX_F32_SIGNATURES = (("tiles_ready", ()), ("amx_linear_f32", _ARGS))
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def load(march: str = NATIVE):
    """The compiled library for `march` (the host's; tests also load AVX2's), or None."""
    return load_library("small_linear", _SIGNATURES, march)


def load_amx():
    """The AMX library (kernels/cpu/amx_linear.c, built for the host), or None."""
    return load_library("amx_linear", _AMX_SIGNATURES, NATIVE)


def load_amx_f32():
    """fp32 on the tile unit (kernels/cpu/amx_linear_f32.c, built for the host), or None."""
    return load_library("amx_linear_f32", _AMX_F32_SIGNATURES, NATIVE)


@functools.cache
def amx_available() -> bool:
    """AMX linears run here: the build has the tile unit and the OS lets this process use it."""
    library = load_amx()
    return library is not None and library.tiles_ready() == 0


@dataclass(frozen=True)
class PackedView:
    """oneDNN's packed weight [out, in] (kept alive here) and its buffer's address."""

    packed: torch.Tensor
    address: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    cols: int = COLS  # of a column block: AMX_COLS runs on the tile unit


def column_blocks(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as 64-column blocks, a view [N/64][K][64] (oneDNN's fp32 AB16b64a)."""
    n, k = weight.shape
    return weight.view(n // COLS, COLS, k).permute(0, 2, 1)


def blocked_ref(weight: torch.Tensor, cols: int = COLS) -> torch.Tensor:
    """`weight` [N, K] in the C code's layout, flat: bf16 [N/cols][K/2][cols][2], fp32
    [N/64][K][64]."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.view(n // cols, cols, k // 2, 2).permute(0, 2, 1, 3).flatten()
    return column_blocks(weight).flatten()


def fits(weight: torch.Tensor, cols: int = COLS) -> bool:
    """A shape and dtype the C code takes (oneDNN pads other shapes)."""
    n, k = weight.shape
    align = K_ALIGN.get(weight.dtype)
    return align is not None and n % cols == 0 and k % align == 0 and weight.device.type == "cpu"


def view_packed(weight: torch.Tensor, packed: torch.Tensor) -> PackedView | None:
    """The C code's view of `packed` (oneDNN's reorder of `weight`), or None where the buffer
    is in no layout it reads."""
    if not packed.is_mkldnn or not hasattr(torch.ops.mkldnn, "data_ptr"):
        return None  # (data_ptr and _nbytes: the ops inductor's C++ wrapper reads buffers by)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != weight.numel() * weight.element_size():
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    buffer = (ctypes.c_char * nbytes).from_address(address)
    in_place = torch.frombuffer(buffer, dtype=weight.dtype)  # no copy
    widths = (COLS, AMX_COLS) if weight.dtype == torch.bfloat16 else (COLS,)
    for cols in widths:
        if fits(weight, cols) and _blocks_match(in_place, weight, cols):
            return PackedView(packed, address, *weight.shape, weight.dtype, cols)
    return None


def _blocks_match(in_place: torch.Tensor, weight: torch.Tensor, cols: int) -> bool:
    """The buffer's first and last column blocks are `weight`'s in the layout of `cols`: the
    layout inside a block and the blocks' order (the whole weight took 0.4-0.5 s for SmolLM2's
    lm_head, at every load)."""
    block = cols * weight.shape[1]
    return torch.equal(in_place[:block], blocked_ref(weight[:cols], cols)) and torch.equal(
        in_place[-block:], blocked_ref(weight[-cols:], cols)
    )


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """The library builds here (the engine also asks isa.py whether it pays)."""
    return dtype in _SUFFIX and load() is not None


def runs(view: PackedView) -> bool:
    """The kernel for `view`'s layout runs here."""
    return amx_available() if view.cols == AMX_COLS else available(view.dtype)


def small_linear(
    x: torch.Tensor, weight: PackedView, bias: torch.Tensor | None, march: str = NATIVE
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, accumulated in float32; on the tile
    unit where the view is oneDNN's AMX layout (then always the host's build)."""
    library = load_amx() if weight.cols == AMX_COLS else load(march)
    assert library is not None, "the caller checks runs()"
    assert x.dtype == weight.dtype and x.dim() == 2 and x.shape[1] == weight.in_features, (
        f"x {tuple(x.shape)} {x.dtype} against a {weight.out_features}x{weight.in_features} "
        f"{weight.dtype} weight"
    )
    assert bias is None or (bias.dtype == x.dtype and bias.shape == (weight.out_features,))
    name = "amx_linear_bf16" if weight.cols == AMX_COLS else f"small_linear_{_SUFFIX[x.dtype]}"
    return _run(getattr(library, name), x, weight, bias)


def _run(function, x: torch.Tensor, weight: PackedView, bias: torch.Tensor | None):
    """One of the library's entry points over `weight`: out [M, N] in x's dtype (checked)."""
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    status = function(
        x.data_ptr(),
        x.shape[0],
        weight.in_features,
        weight.address,
        weight.out_features,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise _failure(function, status)
    return out


def _failure(function, status: int) -> Exception:
    """The entry points' nonzero statuses: 1 a shape they do not take (the callers check
    shapes first, so a bug), 2 no memory for amx_linear_f32's split of x."""
    if status == 2:
        return MemoryError(f"{function.__name__}: no memory for the parts of x")
    return AssertionError(f"{function.__name__}: shapes the caller should have checked")


def block_bf16(weight: torch.Tensor) -> PackedView | None:
    """A bf16 `weight` [N, K] copied into 64-column blocks, [N/64][K][64], for
    `small_linear_bf16w`; None where the shape does not fit or the library does not build."""
    if weight.dtype != torch.bfloat16 or not fits(weight) or load() is None:
        return None
    blocked = column_blocks(weight).contiguous()
    return PackedView(blocked, blocked.data_ptr(), *weight.shape, torch.bfloat16)


def small_linear_bf16w(
    x: torch.Tensor, weight: PackedView, bias: torch.Tensor | None, march: str = NATIVE
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, `weight` from block_bf16: each
    product in float32 (bf16 values multiply exactly there), summed in float32, rounded once."""
    library = load(march)
    assert library is not None, "block_bf16 checked the library"
    assert x.dim() == 2 and x.shape[1] == weight.in_features, (
        f"x {tuple(x.shape)} against a {weight.out_features}x{weight.in_features} weight"
    )
    assert bias is None or bias.shape == (weight.out_features,)
    fp32_bias = None if bias is None else bias.float()
    return _run(library.small_linear_bf16w, x.float(), weight, fp32_bias).to(x.dtype)


def split_planes(weight: torch.Tensor) -> PackedView | None:
    """An fp32 `weight` [N, K] as three bf16 parts (w1 = bf16(w), w2 = bf16(w - w1),
    w3 = bf16(w - w1 - w2)), each in the AMX layout, one after another, for `tile_linear_f32`;
    None where the shape does not fit the tiles or the library does not run here."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % AMX_COLS or k % 32 or weight.device.type != "cpu":
        return None
    if not amx_available() or load_amx_f32() is None:
        return None
    planes = torch.cat([blocked_ref(part, AMX_COLS) for part in bf16_parts(weight)])
    return PackedView(planes, planes.data_ptr(), n, k, torch.float32, AMX_COLS)


def bf16_parts(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `values` as three bf16 parts, each the rounding (to nearest even) of what the ones
    before it left; the remainders are exact in fp32, and for values of magnitude 2^-100 to
    2^126 (where no remainder falls below fp32's normals) the three sum back to `values`
    exactly: 8 significant bits each, 24 in all."""
    first = values.to(torch.bfloat16)
    rest = values - first.float()
    second = rest.to(torch.bfloat16)
    return first, second, (rest - second.float()).to(torch.bfloat16)


def tile_linear_f32(x: torch.Tensor, weight: PackedView, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in float32, `weight` from split_planes: the six
    largest of the parts' nine products, summed in float32 on the tile unit."""
    library = load_amx_f32()
    assert library is not None, "split_planes checked the library"
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == weight.in_features
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (weight.out_features,))
    return _run(library.amx_linear_f32, x, weight, bias)
