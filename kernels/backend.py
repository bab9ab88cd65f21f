"""Choice of kernel implementation: Triton kernels (CUDA), the CPU set (C kernels for decode
attention, the cache write, rotary embedding, RMSNorm and the MLP activation, torch twins for
the rest; C latent attention for DeepSeek's MLA), or the pure-torch twins alone.

Every set satisfies the contracts of kernels/ops.py, so the engine holds one `KernelOps` and
never branches on the backend. Triton is imported only when the "triton" set is asked for.
"""

import dataclasses
from dataclasses import dataclass

import torch
from kvpager.kernels import ops, reference, reference_mla, reference_moe
from kvpager.schemas.errors import ConfigError


@dataclass(frozen=True)
class KernelOps:
    """The cache kernels and per-layer ops of one backend, each satisfying its contract in
    kernels/ops.py (the ops may work in place: callers use what they return)."""

    reshape_and_cache: ops.ReshapeAndCache
    paged_attention: ops.PagedAttention
    copy_blocks: ops.CopyBlocks
    swap_blocks: ops.SwapBlocks
    rotary: ops.Rotary = reference.rotary_ref
    add_rms_norm: ops.AddRmsNorm = reference.add_rms_norm_ref
    silu_and_mul: ops.SiluAndMul = reference.silu_and_mul_ref
    gelu_tanh_and_mul: ops.GeluTanhAndMul = reference.gelu_tanh_and_mul_ref
    gelu_and_mul: ops.GeluAndMul = reference.gelu_and_mul_ref  # hidden_act "gelu" (exact)
    fused_moe: ops.FusedMoe = reference_moe.fused_moe_ref
    mla_attention: ops.MlaAttention = reference_mla.mla_paged_attention_ref  # DeepSeek's latents
    # routed experts on oneDNN-packed matmuls where the decoder packs its weights and that pays
    # (bf16: engine/model/packed_experts.py, the twin's loop) instead of `fused_moe`
    pack_experts: bool = False
    # the order of the values inside a cache block that reshape_and_cache and paged_attention
    # share ("token-major", kernels/ops.py's; or kernels/cpu_tiles.py's "amx-tiles")
    kv_layout: str = "token-major"


def _torch_ops() -> KernelOps:
    return KernelOps(
        reshape_and_cache=reference.reshape_and_cache_ref,
        paged_attention=reference.paged_attention_ref,
        copy_blocks=reference.copy_blocks_ref,
        swap_blocks=reference.swap_blocks_ref,
    )


def _cpu_ops() -> KernelOps:
    """The torch twins, with decode attention (kernels/cpu_decode.py) and the per-layer ops
    (kernels/cpu_layer_ops.py) on C kernels, block swaps as runs of copies
    (kernels/cpu_block_ops.py), and bf16 routed experts on packed matmuls."""
    from kvpager.kernels import cpu_layer_ops
    from kvpager.kernels.cpu_block_ops import swap_blocks_cpu
    from kvpager.kernels.cpu_decode import paged_attention_cpu
    from kvpager.kernels.cpu_mla import mla_attention_cpu

    return dataclasses.replace(
        _torch_ops(),
        paged_attention=paged_attention_cpu,
        mla_attention=mla_attention_cpu,
        reshape_and_cache=cpu_layer_ops.reshape_and_cache,
        rotary=cpu_layer_ops.rotary,
        add_rms_norm=cpu_layer_ops.add_rms_norm,
        silu_and_mul=cpu_layer_ops.silu_and_mul,
        gelu_tanh_and_mul=cpu_layer_ops.gelu_tanh_and_mul,
        swap_blocks=swap_blocks_cpu,
        pack_experts=True,
    )


def _triton_ops() -> KernelOps:
    try:
        from kvpager.kernels.block_ops import copy_blocks, swap_blocks
        from kvpager.kernels.kv_write import reshape_and_cache
        from kvpager.kernels.mla_attention import mla_paged_attention
        from kvpager.kernels.moe import fused_moe
        from kvpager.kernels.paged_attention import paged_attention
    except ImportError as error:
        raise ConfigError(f"the triton kernel backend cannot be imported: {error}") from error

    return KernelOps(
        reshape_and_cache=reshape_and_cache,
        paged_attention=paged_attention,
        copy_blocks=copy_blocks,
        swap_blocks=swap_blocks,
        fused_moe=fused_moe,
        mla_attention=mla_paged_attention,
    )


_BACKENDS = {"torch": _torch_ops, "cpu": _cpu_ops, "triton": _triton_ops}


def with_cache_layout(
    kernel_ops: KernelOps,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    softcap: float = 0.0,
    wanted: str = "auto",
) -> KernelOps:
    """The CPU set over a cache in the AMX tile layout where that fits (kernels/cpu_tiles.py:
    an AMX host, bf16 model and cache; shape = (num_heads, num_kv_heads, head_dim, block_size)
    per rank), else `kernel_ops` as it is; `wanted` "token-major" (the kv_layout setting)
    keeps it as it is always. Picked once, before the cache is first written."""
    from kvpager.kernels import cpu_tiles

    if kernel_ops.paged_attention is not _cpu_paged_attention() or wanted != "auto":
        return kernel_ops
    if not cpu_tiles.fits(dtype, kv_dtype, *shape, softcap=softcap):
        return kernel_ops
    return dataclasses.replace(
        kernel_ops,
        reshape_and_cache=cpu_tiles.reshape_and_cache_tiles,
        paged_attention=cpu_tiles.paged_attention_tiles,
        kv_layout=cpu_tiles.LAYOUT,
    )


def _cpu_paged_attention():
    from kvpager.kernels.cpu_decode import paged_attention_cpu

    return paged_attention_cpu


def get_kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` ("torch", "cpu" or "triton"); ConfigError otherwise."""
    if name not in _BACKENDS:
        raise ConfigError(f"unknown kernel backend {name!r}; expected one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def default_backend_name(device: torch.device) -> str:
    """ "triton" on a CUDA device; on CPU "cpu" when its C kernel builds here, else "torch"."""
    if device.type == "cuda":
        return "triton"
    from kvpager.kernels import cpu_decode

    return "cpu" if cpu_decode.load() is not None else "torch"


def check_backend_device(name: str, device: torch.device) -> None:
    """ConfigError for the C kernels on a device other than the CPU: they read host memory.
    (Triton on CPU tensors is left to Triton: its interpreter runs there, the tests use it.)"""
    if name == "cpu" and device.type != "cpu":
        raise ConfigError(
            f"attention_backend 'cpu' runs on a CPU device, not {device.type}: "
            "set device='cpu' or another attention_backend"
        )
