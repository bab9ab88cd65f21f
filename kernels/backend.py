"""Choice of kernel implementation: Triton kernels (CUDA), the CPU set (torch twins plus a C
decode-attention kernel), or the pure-torch twins alone.

Both sets share signatures (see `kernels.reference`), so the engine holds one `KernelOps` and
never branches on the backend. Triton is imported only when the "triton" set is asked for.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from kernels import reference


@dataclass(frozen=True)
class KernelOps:
    """The four cache kernels of one backend, called with the reference signatures."""

    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]


def _torch_ops() -> KernelOps:
    return KernelOps(
        reshape_and_cache=reference.reshape_and_cache_ref,
        paged_attention=reference.paged_attention_ref,
        copy_blocks=reference.copy_blocks_ref,
        swap_blocks=reference.swap_blocks_ref,
    )


def _cpu_ops() -> KernelOps:
    """The torch twins, with decode attention on the C kernel (kernels/cpu_decode.py)."""
    from kernels.cpu_decode import paged_attention_cpu

    return dataclasses.replace(_torch_ops(), paged_attention=paged_attention_cpu)


def _triton_ops() -> KernelOps:
    try:
        from kernels.block_ops import copy_blocks, swap_blocks
        from kernels.kv_write import reshape_and_cache
        from kernels.paged_attention import paged_attention
    except ImportError as error:
        raise ConfigError(f"the triton kernel backend cannot be imported: {error}") from error

    return KernelOps(
        reshape_and_cache=reshape_and_cache,
        paged_attention=paged_attention,
        copy_blocks=copy_blocks,
        swap_blocks=swap_blocks,
    )


_BACKENDS = {"torch": _torch_ops, "cpu": _cpu_ops, "triton": _triton_ops}


def get_kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` ("torch", "cpu" or "triton"); ConfigError otherwise."""
    if name not in _BACKENDS:
        raise ConfigError(f"unknown kernel backend {name!r}; expected one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def default_backend_name() -> str:
    """ "triton" with a CUDA device; else "cpu" when its C kernel builds here, else "torch"."""
    if torch.cuda.is_available():
        return "triton"
    from kernels import cpu_decode

    return "cpu" if cpu_decode.load() is not None else "torch"
