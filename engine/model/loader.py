"""Read a Hugging Face checkpoint folder's safetensors into the engine's Decoder.

Single files and sharded checkpoints (`model.safetensors.index.json`) both work. Nothing is
unpickled: `.bin` / `.pt` weights are refused. A tensor-parallel rank reads only its rows or
columns of each tensor (`get_slice`), so no rank ever holds a whole sharded matrix.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.decoder import Decoder
from engine.model.sharding import Part, Shard
from engine.parallel.group import TensorParallel
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


def iter_slices(path: Path) -> Iterator[tuple[str, Callable[[Part], torch.Tensor]]]:
    """(name, read) per checkpoint tensor; `read(part)` reads that part of it from the file."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, _reader(handle.get_slice(name))


def _reader(tensor_slice) -> Callable[[Part], torch.Tensor]:
    def read(part: Part) -> torch.Tensor:
        if part is None:
            return tensor_slice[:]
        dim, start, stop = part
        return tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]

    return read


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


def _target(model: Decoder, name: str) -> tuple[torch.Tensor | None, int, Part] | None:
    """(parameter, row offset, the part of the tensor this rank reads) for a checkpoint name."""
    name = name.removeprefix("model.")
    shard = model.shard
    vocab = shard.vocab_part(model.config.vocab_size) if shard.is_sharded else None
    if name == "embed_tokens.weight":
        return model.embed_tokens, 0, vocab
    if name == "norm.weight":
        return model.norm, 0, None
    if name == "lm_head.weight":
        return (None if model.config.tie_word_embeddings else model.lm_head), 0, vocab
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        target = _layer_targets(model.layers[int(idx)], rest)
        return None if target is None else (*target, shard.layer_part(rest))
    return None


def load_weights(model: Decoder, path: Path) -> int:
    """Copy every checkpoint tensor (this rank's part of it) into its (possibly fused)
    parameter slice; returns the bytes read."""
    expected = {id(p): p.numel() for p in model.parameters()}
    filled = _vocab_padding(model)
    num_bytes = 0
    for name, read in iter_slices(path):
        target = _target(model, name)
        if target is None or target[0] is None:
            continue  # rotary buffers, tied lm_head, and the like
        param, offset, part = target
        tensor = read(part)
        num_bytes += tensor.numel() * tensor.element_size()
        if tensor.shape[1:] != param.shape[1:] or offset + tensor.shape[0] > param.shape[0]:
            raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} does not fit the config")
        param.data[offset : offset + tensor.shape[0]].copy_(tensor)
        filled[id(param)] = filled.get(id(param), 0) + tensor.numel()
    missing = [n for n, p in model.named_parameters() if filled.get(id(p)) != expected[id(p)]]
    if missing:
        raise CheckpointError(f"{path}: weights missing or incomplete for {missing[:5]}")
    return num_bytes


def _vocab_padding(model: Decoder) -> dict[int, int]:
    """Zero the vocab rows past the real vocab (the last rank's padding); their counts."""
    start, stop = model.shard.vocab_part(model.config.vocab_size)[1:]
    padding = model.shard.vocab_per_rank - (stop - start)
    filled = {}
    for param in {id(p): p for p in (model.embed_tokens, model.lm_head)}.values():
        param.data[stop - start :].zero_()
        filled[id(param)] = padding * param.shape[1]
    return filled


def load_model(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    ops: KernelOps,
    shard: Shard | None = None,
    group: TensorParallel | None = None,
) -> Decoder:
    model = Decoder(config, dtype, max_positions, ops, shard, group)
    load_weights(model, path)
    model = model.to(device).eval()
    model.build_matmuls()
    return model
