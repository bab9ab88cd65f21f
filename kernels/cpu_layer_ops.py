"""The per-layer ops of the CPU backend on C (kernels/cpu/layer_ops.c), with the torch twins
(kernels/reference.py) for whatever the C code does not take: other dtypes, strides, or no
compiler. Same signatures as the twins; the C paths work in place where the twins allocate.

The C code computes in float32 for float32 and bfloat16 tensors alike: bf16 values are widened
as they are loaded and rounded once as they are stored, so results match the twins computed in
float32 on the widened inputs, rounded once to bfloat16 (the twins in bf16 round after every
op, and ran ~0.5 s of a bf16 SmolLM2 decode step against ~0.1 s for the C path).
"""

import torch
from kvpager.kernels import reference
from kvpager.kernels.cpu_build import FLOAT, I64, NATIVE, PTR, load_library

_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_ADD_RMS_NORM = (PTR, PTR, PTR, PTR, I64, I64, FLOAT)
_HEAD_RMS_NORM = (PTR, I64, PTR, PTR, I64, I64, I64, FLOAT)
_PER_DTYPE = (
    ("rope_neox", (PTR, I64, I64, I64, I64, PTR, PTR)),
    ("add_rms_norm", _ADD_RMS_NORM),
    ("silu_and_mul", (PTR, PTR, I64, I64)),
    ("gelu_tanh_and_mul", (PTR, PTR, I64, I64)),
    ("head_rms_norm", _HEAD_RMS_NORM),
)
_WRITE_KV_FP8 = (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64, FLOAT, FLOAT)
_SUFFIXES = ("f32", "bf16")
_SIGNATURES = (
    ("write_kv", (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64)),
    ("add_rms_norm_bf16_f32_weight", _ADD_RMS_NORM),  # bf16 rows, Gemma's fp32 (1 + w)
    ("head_rms_norm_bf16_f32_weight", _HEAD_RMS_NORM),
    *((f"write_kv_{fp8}_{suffix}", _WRITE_KV_FP8) for fp8 in _FP8.values() for suffix in _SUFFIXES),
    *((f"{name}_{suffix}", argtypes) for name, argtypes in _PER_DTYPE for suffix in _SUFFIXES),
)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load(march: str = NATIVE):
    """The compiled library for `march` (the host's; tests also load AVX2's), or None when it
    cannot be built here."""
    return load_library("layer_ops", _SIGNATURES, march)


def _kernel(name: str, *tensors: torch.Tensor):
    """The C function `name` for the tensors' dtype, or None: no library, tensors of mixed or
    other dtypes, or not on the CPU."""
    library = load()
    if library is None or not _same_cpu_dtype(*tensors):
        return None
    return getattr(library, f"{name}_{_SUFFIX[tensors[0].dtype]}")


def _same_cpu_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _SUFFIX and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def rows_of_heads(x: torch.Tensor) -> bool:
    """[T, heads, d] with each token's heads back to back (a view into a qkv row is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    library = load()
    fp8 = key_cache.dtype in _FP8 and value_cache.dtype == key_cache.dtype
    fits = (
        (_same_cpu_dtype(key, value, key_cache, value_cache) or fp8 and _same_cpu_dtype(key, value))
        and rows_of_heads(key)
        and rows_of_heads(value)
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )
    if library is None or not fits:
        return reference.reshape_and_cache_ref(
            key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
    slots = slot_mapping.to(torch.int64).contiguous()
    if fp8:  # quantised as written: x / scale, clamped, rounded to nearest even
        write = getattr(library, f"write_kv_{_FP8[key_cache.dtype]}_{_SUFFIX[key.dtype]}")
        write(
            key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
            key.shape[0], key.shape[1] * key.shape[2], k_scale, v_scale,
        )  # fmt: skip
        return None
    size = key.element_size()  # rows are copied as bytes: fp32 or bf16 alike
    library.write_kv(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0) * size,
        value.stride(0) * size,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2] * size,
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _kernel("rope_neox", q, k, cos, sin)
    if kernel is None or not (rows_of_heads(q) and rows_of_heads(k)) or q.shape[-1] % 2:
        return reference.rotary_ref(q, k, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    for x in _rotary_rows(q, k):
        num_tokens, num_heads, head_dim = x.shape
        kernel(
            x.data_ptr(),
            x.stride(0),
            num_tokens,
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
        )
    return q, k


def _rotary_rows(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q and k as the kernel's calls take them: one call over both when k's heads follow q's
    in the same rows (views of one qkv row), so the layer has one parallel region, not two."""
    num_heads = q.shape[1] + k.shape[1]
    one_row = q.shape[0] == 1  # a single token's row stride is never read
    adjacent = (
        one_row or q.stride(0) == k.stride(0) >= num_heads * q.shape[2]
    ) and k.data_ptr() == q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size()
    if not adjacent or q.shape[2] != k.shape[2]:
        return (q, k)
    return (q.as_strided((q.shape[0], num_heads, q.shape[2]), q.stride()),)


def _norm_kernel(rows: tuple[torch.Tensor, ...], weight: torch.Tensor, name: str = "add_rms_norm"):
    """The C norm `name` for rows and a weight of one dtype, or for bf16 rows beside a
    float32 weight (Gemma's (1 + w), scaled in fp32 as the twin does); None otherwise."""
    gemma = rows[0].dtype == torch.bfloat16 and weight.dtype == torch.float32
    if not gemma:
        return _kernel(name, *rows, weight)
    library = load()
    if library is None or not (_same_cpu_dtype(*rows) and weight.device.type == "cpu"):
        return None
    return getattr(library, f"{name}_bf16_f32_weight")


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of x [T, heads, d] normed (q/k norms), read in place from a qkv view."""
    kernel = _norm_kernel((x,), weight, "head_rms_norm")
    if kernel is None or not (rows_of_heads(x) and weight.is_contiguous()):
        return reference.rms_norm_ref(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    num_tokens, num_heads, head_dim = x.shape
    kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), num_tokens, num_heads,
           head_dim, eps)  # fmt: skip
    return out


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is None and residual.dim() == 3:  # heads [T, heads, d]: q/k norms
        return _head_rms_norm(residual, weight, eps), residual
    rows = (residual,) if delta is None else (residual, delta)
    tensors = (*rows, weight)
    kernel = _norm_kernel(rows, weight)
    fits = (
        residual.dim() == 2
        and (delta is None or delta.shape == residual.shape)
        and all(t.is_contiguous() for t in tensors)
    )
    if kernel is None or not fits:
        return reference.add_rms_norm_ref(residual, delta, weight, eps)
    out = torch.empty_like(residual)
    kernel(
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual.shape[0],
        residual.shape[1],
        eps,
    )
    return out, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated("silu_and_mul", gate_up, reference.silu_and_mul_ref)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated("gelu_tanh_and_mul", gate_up, reference.gelu_tanh_and_mul_ref)


def _gated(name: str, gate_up: torch.Tensor, twin) -> torch.Tensor:
    """act(gate) * up over gate_up's halves on the C kernel `name`, else on the twin."""
    kernel = _kernel(name, gate_up)
    fits = gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
    if kernel is None or not fits:
        return twin(gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), num_tokens, inter)
    return out
