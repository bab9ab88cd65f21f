"""Granite 4 hybrid checkpoint names (after `layers.<i>.`) and where they go: a Mamba layer's
`mamba.*` into its Mamba2Mixer, `shared_mlp.{input,output}_linear` into the layer's (fused
gate|up, down) MLP, `block_sparse_moe.*` into its routed experts, stacked as the engine
stacks them ([E, 2I, H] and [E, H, I]). One rank only (ModelConfig.check_tensor_parallel)."""

from collections.abc import Callable

import torch

Transform = Callable[[torch.Tensor], torch.Tensor] | None


def granite_params(layer, name: str) -> list[tuple[torch.Tensor, Transform]] | None:
    """(parameter, transform) for a per-layer Granite name; None: not a Granite name."""
    group, _, kind = name.partition(".")
    if group == "mamba" and layer.mixer is not None:
        return _mixer_params(layer.mixer, kind)
    if group == "shared_mlp":
        params = {"input_linear.weight": layer.gate_up_weight,
                  "output_linear.weight": layer.down_weight}  # fmt: skip
        return [(params[kind], None)] if kind in params else None
    if group == "block_sparse_moe" and kind in _EXPERT_NAMES and layer.experts is not None:
        return [(getattr(layer.experts, _EXPERT_NAMES[kind]), None)]
    return None


_EXPERT_NAMES = {
    "router.layer.weight": "router",
    "input_linear.weight": "gate_up",
    "output_linear.weight": "down",
}


def _mixer_params(mixer, kind: str) -> list[tuple[torch.Tensor, Transform]] | None:
    params = {
        "in_proj.weight": mixer.in_proj,
        "in_proj.bias": mixer.in_proj_bias,
        "conv1d.weight": mixer.conv_weight,  # [conv_dim, 1, K] in the checkpoint
        "conv1d.bias": mixer.conv_bias,
        "dt_bias": mixer.dt_bias,
        "A_log": mixer.A_log,
        "D": mixer.D,
        "norm.weight": mixer.norm_weight,
        "out_proj.weight": mixer.out_proj,
        "out_proj.bias": mixer.out_proj_bias,
    }
    param = params.get(kind)
    if param is None:
        return None
    return [(param, _squeeze_channel if kind == "conv1d.weight" else None)]


def _squeeze_channel(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[:, 0]
