"""Choice of kernel implementation: Triton kernels or their pure-torch twins (CPU serving).

Both sets share signatures (see `kernels.reference`), so the engine holds one `KernelOps` and
never branches on the backend. Triton is imported only when the "triton" set is asked for.
"""

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


_BACKENDS = {"torch": _torch_ops, "triton": _triton_ops}


def get_kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` ("torch" or "triton"); ConfigError for anything else."""
    if name not in _BACKENDS:
        raise ConfigError(f"unknown kernel backend {name!r}; expected one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def default_backend_name() -> str:
    """Return "triton" when a CUDA device is present, else "torch" (interpreter is for tests)."""
    return "triton" if torch.cuda.is_available() else "torch"
