"""Per-layer scales of an fp8 KV cache, read from a checkpoint that has them.

An fp8 cache stores q = clamp(x / scale) and attention reads x = q * scale (kernels/
reference.py). Quantised checkpoints (llm-compressor, ModelOpt, AutoFP8) carry one K and one V
scale a layer under vLLM's names:

    model.layers.N.self_attn.k_scale / v_scale
    model.layers.N.self_attn.k_proj.output_scale / v_proj.output_scale
    model.layers.N.self_attn.kv_scale                (older: one scale for both)

A layer without them keeps 1.0, vLLM's default: e4m3 then holds |x| up to 448 with 3 mantissa
bits at every magnitude from 2^-6 up, which covers the K/V of models trained in bf16 (SmolLM2's
largest |K| on its chat prompts is ~16, |V| ~3; see docs/user/fp8.md), and e5m2 up to 57344.
"""

import re
from collections.abc import Callable, Iterable

import torch
from kvpager.schemas.errors import CheckpointError

_NAME = re.compile(
    r"(?:model\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale"
    r"|k_proj\.output_scale|v_proj\.output_scale)"
)
_WHICH = {"k_scale": (0,), "k_proj.output_scale": (0,), "v_scale": (1,)}
_WHICH.update({"v_proj.output_scale": (1,), "kv_scale": (0, 1)})


def read_kv_scales(
    slices: Iterable[tuple[str, Callable[..., torch.Tensor]]], num_layers: int
) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each layer from a checkpoint's (name, read) pairs (the loader's
    iter_slices): its scales where it has them (one with several elements, per head or
    channel, gives its largest: one scale a layer here), else 1.0."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for name, read in slices:
        match = _NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= num_layers:
            continue
        value = float(read(None).float().max())
        if not value > 0:  # NaN too
            raise CheckpointError(f"{name}: a KV cache scale must be positive, got {value}")
        for which in _WHICH[match.group(2)]:
            scales[int(match.group(1))][which] = value
    return [(k, v) for k, v in scales]
