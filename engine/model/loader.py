"""Read a Hugging Face checkpoint folder's safetensors into the engine's Decoder.

Single files and sharded checkpoints (`model.safetensors.index.json`) both work. Nothing is
unpickled: `.bin` / `.pt` weights are refused.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.decoder import Decoder
from kernels.backend import KernelOps
from schemas.errors import CheckpointError


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / name for name in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {pickled}: pickled weights are never loaded)" if pickled else ""
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _layer_targets(layer, name: str):
    """(parameter, row offset) for a per-layer HF weight name, or None if it is not ours."""
    q, kv = layer.q_size, layer.kv_size
    targets = {
        "self_attn.q_proj.weight": (layer.qkv_weight, 0),
        "self_attn.k_proj.weight": (layer.qkv_weight, q),
        "self_attn.v_proj.weight": (layer.qkv_weight, q + kv),
        "self_attn.q_proj.bias": (layer.qkv_bias, 0),
        "self_attn.k_proj.bias": (layer.qkv_bias, q),
        "self_attn.v_proj.bias": (layer.qkv_bias, q + kv),
        "self_attn.o_proj.weight": (layer.o_weight, 0),
        "mlp.gate_proj.weight": (layer.gate_up_weight, 0),
        "mlp.up_proj.weight": (layer.gate_up_weight, layer.gate_up_weight.shape[0] // 2),
        "mlp.down_proj.weight": (layer.down_weight, 0),
        "input_layernorm.weight": (layer.input_norm, 0),
        "post_attention_layernorm.weight": (layer.post_attention_norm, 0),
    }
    return targets.get(name)


def _target(model: Decoder, name: str):
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return model.embed_tokens, 0
    if name == "norm.weight":
        return model.norm, 0
    if name == "lm_head.weight":
        return (None if model.config.tie_word_embeddings else model.lm_head), 0
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        return _layer_targets(model.layers[int(idx)], rest)
    return None


def load_weights(model: Decoder, path: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter slice."""
    expected = {id(p): p.numel() for p in model.parameters()}
    filled: dict[int, int] = {}
    for name, tensor in iter_tensors(path):
        target = _target(model, name)
        if target is None or target[0] is None:
            continue  # rotary buffers, tied lm_head, and the like
        param, offset = target
        if tensor.shape[1:] != param.shape[1:] or offset + tensor.shape[0] > param.shape[0]:
            raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} does not fit the config")
        param.data[offset : offset + tensor.shape[0]].copy_(tensor)
        filled[id(param)] = filled.get(id(param), 0) + tensor.numel()
    missing = [n for n, p in model.named_parameters() if filled.get(id(p)) != expected[id(p)]]
    if missing:
        raise CheckpointError(f"{path}: weights missing or incomplete for {missing[:5]}")


def load_model(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: KernelOps,
) -> Decoder:
    model = Decoder(config, dtype, max_positions, ops)
    load_weights(model, path)
    model = model.to(device).eval()
    model.build_matmuls()
    return model
