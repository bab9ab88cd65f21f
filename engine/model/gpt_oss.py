"""gpt-oss's pieces beside the one decoder (engine/model/decoder.py takes its sinks and o_proj
bias, engine/model/moe.py its experts through these):

    routing   the router has a bias; the top k of its logits, then a softmax over those k
              (transformers' GptOssTopKRouter), not a softmax over all experts first
    experts   gate_up and down with biases, a clamped SwiGLU between them (reference.py's
              clamped_swiglu_ref); they run on the twin's loop, `fused_moe_ref`, on every
              backend (the Triton grouped kernel and the packed CPU matmuls have no biases)
    weights   the checkpoint stacks every expert in one tensor, x @ W ([E, H, 2I] for
              gate_up, gate and up interleaved column by column; [E, I, H] for down): read
              transposed and de-interleaved into the decoder's [E, 2I, H] (gate rows first) and
              [E, H, I]. A tensor-parallel rank reads its span of I: for gate_up that span of
              the interleaved columns is contiguous (2I_r columns from 2 * rank * I_r).
"""

from collections.abc import Callable

import torch

Transform = Callable[[torch.Tensor], torch.Tensor] | None


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] with the I gate columns first."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _gate_up(x: torch.Tensor) -> torch.Tensor:  # [E, H, 2I] interleaved -> [E, 2I, H]
    return deinterleave(x).transpose(1, 2)


def _down(x: torch.Tensor) -> torch.Tensor:  # [E, I, H] -> [E, H, I]
    return x.transpose(1, 2)


# checkpoint name (after `mlp.`) -> (RoutedExperts attribute, dim of the checkpoint tensor
# split over ranks (None: replicated), its columns per intermediate row, transform to ours)
EXPERT_TENSORS: dict[str, tuple[str, int | None, int, Transform]] = {
    "router.weight": ("router", None, 0, None),
    "router.bias": ("router_bias", None, 0, None),
    "experts.gate_up_proj": ("gate_up", 2, 2, _gate_up),
    "experts.gate_up_proj_bias": ("gate_up_bias", 1, 2, deinterleave),
    "experts.down_proj": ("down", 1, 1, _down),
    "experts.down_proj_bias": ("down_bias", None, 0, None),
}


def route_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): the top k logits, softmaxed
    over those k (gpt-oss's router)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids
