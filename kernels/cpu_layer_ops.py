"""The per-layer ops of the CPU backend on C (kernels/cpu/layer_ops.c), with the torch twins
(kernels/reference.py) for whatever the C code does not take: other dtypes, strides, or no
compiler. Same signatures as the twins; the C paths work in place where the twins allocate.

The C code computes in float32. A bfloat16 model's tensors are widened on the way in and
narrowed on the way out (one vectorised copy each, cheap next to the twins' chains of bf16
ops: a bf16 SmolLM2 decode step spent ~0.5 s in them against ~0.1 s for the fp32 C path), so
results match the twins computed in float32, rounded once to bfloat16.
"""

import torch

from kernels import reference
from kernels.cpu_build import FLOAT, I64, PTR, load_library

_SIGNATURES = (
    ("write_kv", (PTR, PTR, I64, I64, PTR, PTR, PTR, I64, I64)),
    ("rope_neox", (PTR, I64, I64, I64, I64, PTR, PTR)),
    ("add_rms_norm", (PTR, PTR, PTR, PTR, I64, I64, FLOAT)),
    ("silu_and_mul", (PTR, PTR, I64, I64)),
)


def load():
    """The compiled library, or None when it cannot be built here."""
    return load_library("layer_ops", _SIGNATURES)


def _f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def _rows_of_heads(x: torch.Tensor) -> bool:
    """[T, heads, d] with each token's heads back to back (a view into a qkv row is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    library = load()
    fits = (
        (_f32(key, value, key_cache, value_cache) or _bf16(key, value, key_cache, value_cache))
        and _rows_of_heads(key)
        and _rows_of_heads(value)
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )
    if library is None or not fits:
        return reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64).contiguous()
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
    if _bf16(q, k, cos, sin) and load() is not None:  # widened, rotated, narrowed in place
        q32, k32 = rotary(q.float(), k.float(), cos.float(), sin.float())
        return q.copy_(q32), k.copy_(k32)
    library = load()
    fits = _f32(q, k, cos, sin) and _rows_of_heads(q) and _rows_of_heads(k)
    if library is None or not fits or q.shape[-1] % 2:
        return reference.rotary_ref(q, k, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k):
        num_tokens, num_heads, head_dim = x.shape
        library.rope_neox(
            x.data_ptr(),
            x.stride(0),
            num_tokens,
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
        )
    return q, k


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = (residual, weight) if delta is None else (residual, delta, weight)
    if _bf16(*tensors) and load() is not None:
        wide = None if delta is None else delta.float()
        out, summed = add_rms_norm(residual.float(), wide, weight.float(), eps)
        return out.to(torch.bfloat16), summed.to(torch.bfloat16)
    library = load()
    fits = (
        _f32(*tensors)
        and residual.dim() == 2
        and (delta is None or delta.shape == residual.shape)
        and all(t.is_contiguous() for t in tensors)
    )
    if library is None or not fits:
        return reference.add_rms_norm_ref(residual, delta, weight, eps)
    out = torch.empty_like(residual)
    library.add_rms_norm(
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
    if _bf16(gate_up) and load() is not None:
        return silu_and_mul(gate_up.float()).to(torch.bfloat16)
    library = load()
    fits = _f32(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()
    if library is None or not fits or gate_up.shape[1] % 2:
        return reference.silu_and_mul_ref(gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter)
    library.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), num_tokens, inter)
    return out
