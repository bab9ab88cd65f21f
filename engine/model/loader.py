"""Read a Hugging Face checkpoint folder's safetensors into the engine's Decoder.

Single files and sharded checkpoints (`model.safetensors.index.json`) both work. Nothing is
unpickled: `.bin` / `.pt` weights are refused. A tensor-parallel rank reads only its rows or
columns of each tensor (`get_slice`), so no rank ever holds a whole sharded matrix.
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from kvpager.engine.families.nemotron_h import checkpoint_name
from kvpager.engine.families.qwen3_5 import text_weight_name
from kvpager.engine.model import gpt_oss
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.kv_scales import read_kv_scales
from kvpager.engine.model.qwen3_next.layer_pieces import PieceFill, piece_tensor
from kvpager.engine.model.qwen3_next.sharded import piece_parts
from kvpager.engine.model.sharding import MIXTRAL_NAMES, Part, Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.group import TensorParallel
from kvpager.kernels.backend import KernelOps
from kvpager.schemas.errors import CheckpointError
from safetensors import safe_open


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
        if part is None:  # a 0-dim tensor (a KV cache scale) takes no slice
            return tensor_slice[:] if tensor_slice.get_shape() else tensor_slice[()]
        dim, start, stop = part
        return tensor_slice[(slice(None),) * dim + (slice(start, stop),)]

    return read


class Target(NamedTuple):
    """Where (part of) a checkpoint tensor goes: `param` rows from `offset` (of `expert`'s
    slice of a stacked expert parameter), read as `part` of the checkpoint tensor, then
    `transform`ed where the checkpoint's layout is not the parameter's (gpt-oss's stacked
    experts, Llama 4's). `dim` 1: the offset is along the parameter's second dim (a rank's
    gate and up rows of Granite's stacked [E, 2I, H] experts)."""

    param: torch.Tensor | None
    offset: int
    part: Part
    expert: int | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    dim: int = 0


def _attention_targets(layer, kind: str, shard: Shard) -> list[Target] | None:
    if layer.mla is not None and kind != "o_proj.bias":  # DeepSeek's: its own names, by heads
        param, transform, part = layer.mla.checkpoint_params().get(kind, (None, None, None))
        return None if param is None else [Target(param, 0, part, transform=transform)]
    q, kv = layer.q_size, layer.kv_size
    if kind == "qkv_proj.weight":  # Phi-3's fused q|k|v
        return [Target(layer.qkv_weight, row, shard.fused_part("qkv_proj", i))
                for i, row in enumerate((0, q, q + kv))]  # fmt: skip
    proj, _, tensor = kind.partition(".")
    rows = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}
    if proj in rows and tensor in ("weight", "bias"):  # not an fp8 cache's output_scale
        param = layer.qkv_weight if tensor == "weight" else layer.qkv_bias
        return [Target(param, rows[proj], shard.layer_part(f"self_attn.{kind}"))]
    params = {"o_proj.weight": layer.o_weight, "q_norm.weight": layer.q_norm,
              "k_norm.weight": layer.k_norm}  # fmt: skip
    if kind in params:
        return [Target(params[kind], 0, shard.layer_part(f"self_attn.{kind}"))]
    if kind == "o_proj.bias" and layer.o_bias is not None:  # added after the all-reduce
        return [Target(layer.o_bias, 0, None)]
    if kind == "sinks" and layer.sinks is not None:  # one per query head: the rank's heads
        return [Target(layer.sinks, 0, shard.head_part())]
    return None


def _mlp_targets(layer, kind: str, shard: Shard) -> list[Target] | None:
    if layer.experts is not None and not kind.startswith("shared_experts."):
        return _expert_targets(layer.experts, kind, shard)
    if kind.startswith("shared_experts.") and not layer.has_mlp:
        return []  # DeepSeek's n_shared_experts 0: transformers still saves them, 0 rows wide
    name = f"mlp.{kind}"  # DeepSeek's shared experts split by their own width
    kind = kind.removeprefix("shared_experts.")  # DeepSeek's, beside its routed ones
    half = _up_rows(layer.gate_up_weight, layer.down_weight)
    if kind == "gate_up_proj.weight":  # Phi-3's fused gate|up
        return [Target(layer.gate_up_weight, i * half, shard.fused_part("gate_up_proj", i))
                for i in range(2)]  # fmt: skip
    rows = {"gate_proj.weight": (layer.gate_up_weight, 0),
            "up_proj.weight": (layer.gate_up_weight, half),
            "down_proj.weight": (layer.down_weight, 0)}  # fmt: skip
    if kind not in rows:
        return None
    return [Target(*rows[kind], shard.layer_part(name))]


def _expert_targets(experts, kind: str, shard: Shard) -> list[Target] | None:
    """`gate.weight` (the router) and `experts.<e>.<proj>.weight` (Qwen3-MoE's names, or
    Mixtral's w1 / w3 / w2); gpt-oss's stacked tensors (engine/model/gpt_oss.py)."""
    if experts.gpt_oss:
        return _gpt_oss_expert_targets(experts, kind, shard)
    if kind == "gate.weight":
        return [Target(experts.router, 0, None)]
    if kind == "gate.e_score_correction_bias" and experts.correction_bias is not None:
        return [Target(experts.correction_bias, 0, None)]
    parts = kind.split(".")
    if len(parts) != 4 or parts[0] != "experts":
        return None
    expert, proj = int(parts[1]), MIXTRAL_NAMES.get(parts[2], parts[2])
    half = _up_rows(experts.gate_up[0], experts.down[0])
    rows = {"gate_proj": (experts.gate_up, 0), "up_proj": (experts.gate_up, half),
            "down_proj": (experts.down, 0)}  # fmt: skip
    if proj not in rows:
        return None
    return [Target(*rows[proj], shard.layer_part(f"mlp.{kind}"), expert)]


def _up_rows(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """Where up's rows start in gate|up: after the gate's, none in an ungated MLP (Nemotron-H)."""
    return gate_up.shape[0] - down.shape[1]


def _gpt_oss_expert_targets(experts, kind: str, shard: Shard) -> list[Target] | None:
    if kind not in gpt_oss.EXPERT_TENSORS:
        return None
    name, dim, columns, transform = gpt_oss.EXPERT_TENSORS[kind]
    return [Target(getattr(experts, name), 0, shard.expert_part(dim, columns), None, transform)]


def _norm_targets(layer, kind: str, gemma: bool) -> list[Target] | None:
    # Gemma's post_attention_layernorm is on the attention output; its pre_feedforward one is
    # what the other families call post_attention (the MLP's input norm)
    norms = {"input_layernorm.weight": layer.input_norm,
             "post_attention_layernorm.weight":
                 layer.attn_output_norm if gemma else layer.post_attention_norm,
             "pre_feedforward_layernorm.weight": layer.post_attention_norm if gemma else None,
             "post_feedforward_layernorm.weight": layer.mlp_output_norm}  # fmt: skip
    param = norms.get(kind)
    return None if param is None else [Target(param, 0, None)]


def _feed_forward_targets(layer, kind: str) -> list[Target] | None:
    """Llama 4's `feed_forward.*` (one rank): a dense MLP's gate / up / down, or a MoE layer's
    router, stacked experts ([E, H, 2I] and [E, I, H], transposed to the engine's [E, 2I, H]
    and [E, H, I]) and shared expert."""
    experts = layer.experts
    if experts is not None:
        stacked = {"router.weight": experts.router, "experts.gate_up_proj": experts.gate_up,
                   "experts.down_proj": experts.down}  # fmt: skip
        if kind in stacked:
            transpose = None if kind == "router.weight" else _transpose
            return [Target(stacked[kind], 0, None, transform=transpose)]
        kind = kind.removeprefix("shared_expert.")
    half = layer.gate_up_weight.shape[0] // 2
    rows = {"gate_proj.weight": (layer.gate_up_weight, 0),
            "up_proj.weight": (layer.gate_up_weight, half),
            "down_proj.weight": (layer.down_weight, 0)}  # fmt: skip
    return [Target(*rows[kind], None)] if kind in rows else None


def _transpose(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(-1, -2)


def _pairs_to_halves(head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """q / k rows of a RoPE on adjacent pairs (Llama 4) reordered per head, evens then odds,
    so the rotate-half kernels rotate the same pairs; q . k is unchanged (both reordered)."""
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))

    def reorder(tensor: torch.Tensor) -> torch.Tensor:
        heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
        return heads[:, order].reshape(tensor.shape)

    return reorder


# Granite 4 hybrids' stacked experts, as the engine stacks them ([E, 2I, H] and [E, H, I])
GRANITE_EXPERTS = {
    "block_sparse_moe.router.layer.weight": "router",
    "block_sparse_moe.input_linear.weight": "gate_up",
    "block_sparse_moe.output_linear.weight": "down",
}


def _granite_targets(layer, group: str, kind: str, shard: Shard) -> list[Target] | None:
    """Granite 4 hybrids: a Mamba layer's `mamba.*` into its mixer (a rank's heads:
    engine/model/sharding.py, Mamba2Shard), the shared MLP's fused gate|up and down, the
    experts' stacked tensors (a rank's rows of each, as the other families' MLPs and experts)."""
    if group == "mamba":
        if layer.mixer is None:
            return None
        param, transform = layer.mixer.checkpoint_params().get(kind, (None, None))
        if param is None:
            return None
        return [Target(param, offset, part, transform=transform)
                for offset, part in layer.mixer.shard.parts(kind)]  # fmt: skip
    if group == "shared_mlp":
        params = {"input_linear.weight": (layer.gate_up_weight, 0, 2),
                  "output_linear.weight": (layer.down_weight, 1, 1)}  # fmt: skip
        return _gate_up_rows(*params[kind], shard) if kind in params else None
    if layer.experts is None:
        return None
    name = GRANITE_EXPERTS[f"{group}.{kind}"]
    if name == "router":
        return [Target(layer.experts.router, 0, None)]
    stacked = (1, 2) if name == "gate_up" else (2, 1)  # [E, 2I, H] / [E, H, I]: (dim, pieces)
    return _gate_up_rows(getattr(layer.experts, name), *stacked, shard)


def _gate_up_rows(param: torch.Tensor, dim: int, pieces: int, shard: Shard) -> list[Target]:
    """The rank's rows of each of `pieces` stacked along `dim` of a checkpoint tensor (gate,
    then up; or down's one), each into its half of `param`'s `dim` (the whole at one rank)."""
    if not shard.is_sharded:
        return [Target(param, 0, None)]
    width = param.shape[dim] // pieces  # the rank's rows of one piece
    total = width * shard.world_size
    stacked = param.dim() == 3  # the experts' [E, ...]: the offset is along dim 1
    return [
        Target(param, i * width, (dim, i * total + shard.rank * width,
                                  i * total + (shard.rank + 1) * width), dim=int(stacked))
        for i in range(pieces)
    ]  # fmt: skip


def _layer_targets(layer, name: str, shard: Shard, gemma: bool) -> list[Target] | None:
    """Targets of a per-layer HF weight name (after `layers.<i>.`), or None if it is not ours."""
    group, _, kind = name.partition(".")
    if group in ("mamba", "shared_mlp") or name in GRANITE_EXPERTS:
        return _granite_targets(layer, group, kind, shard)
    if group == "self_attn":
        return _attention_targets(layer, kind, shard)
    if group in ("mlp", "block_sparse_moe"):
        return _mlp_targets(layer, kind, shard)
    if group == "feed_forward":
        return _feed_forward_targets(layer, kind)
    return _norm_targets(layer, name, gemma)


def _rope_rows_reordered(model: Decoder, name: str, targets: list[Target]) -> list[Target]:
    """Llama 4's q_proj / k_proj rows (weight and bias) reordered for rotate-half RoPE."""
    if model.config.mla:  # its rotary rows are its own (engine/model/mla.py)
        return targets
    if not model.config.rope_interleaved or name.split(".")[-2] not in ("q_proj", "k_proj"):
        return targets
    reorder = _pairs_to_halves(model.config.head_dim)
    return [target._replace(transform=reorder) for target in targets]


def _targets(model: Decoder, name: str) -> list[Target] | None:
    """Where a checkpoint tensor goes (this rank's parts of it); None: not one of ours."""
    if model.config.layer_blocks:  # Nemotron-H's names
        name = checkpoint_name(name, model.config.layer_blocks, model.config.recurrent_layers)
    name = name.removeprefix("language_model.").removeprefix("model.")  # Llama 4's text part
    shard = model.shard
    vocab = shard.vocab_part(model.config.vocab_size) if shard.is_sharded else None
    if name == "embed_tokens.weight":
        return [Target(model.embed_tokens, 0, vocab)]
    if name == "norm.weight":
        return [Target(model.norm, 0, None)]
    if name == "lm_head.weight":
        return [Target(None if model.config.tie_word_embeddings else model.lm_head, 0, vocab)]
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if int(idx) >= len(model.layers):  # DeepSeek V3's MTP layer 61: transformers' skip too
            return None
        targets = _layer_targets(model.layers[int(idx)], rest, shard, model.config.gemma_norms)
        return None if targets is None else _rope_rows_reordered(model, rest, targets)
    return None


def load_weights(model: Decoder, path: Path) -> int:
    """Copy every checkpoint tensor (this rank's part of it) into its (possibly fused)
    parameter slice; returns the bytes read. Gemma's norms scale by (1 + w): the 1 is added
    here, once, in float32 (their parameters' dtype) to w as the model's dtype holds it, as
    transformers computes `1 + w.float()`; so every norm kernel scales by its weight (Qwen3-Next's
    too). Qwen3-Next's pieces take their tensors themselves (layer_pieces.py: piece_tensor).
    A multimodal Qwen3.5 checkpoint's text tensors read as the text model's; its vision tower
    and MTP head, none of ours, are skipped."""
    expected = {id(p): p.numel() for p in model.parameters()}
    filled, pieces = _vocab_padding(model), PieceFill()
    num_bytes = 0
    zero_centred = model.config.gemma_norms or model.config.zero_centred_norms
    for name, read in iter_slices(path):
        name = text_weight_name(name)
        if (piece := piece_tensor(model.layers, name.removeprefix("model."))) is not None:
            tensor = _read_parts(read, piece_parts(*piece, model.shard))
            num_bytes += tensor.numel() * tensor.element_size()
            pieces.load(*piece, tensor)
            continue
        for param, offset, part, expert, transform, dim in _targets(model, name) or ():
            if param is None:
                continue  # the tied lm_head
            tensor = read(part)
            num_bytes += tensor.numel() * tensor.element_size()
            tensor = tensor if transform is None else transform(tensor)
            if zero_centred and "norm" in name:
                tensor = tensor.to(model.embed_tokens.dtype).float() + 1.0
            elif model.config.layer_blocks and "norm" in name:  # Nemotron-H: fp32 from the
                tensor = tensor.to(model.embed_tokens.dtype)  # model dtype's weights, as there
            dest = param.data if expert is None else param.data[expert]
            _place(name, dest, tensor, offset, dim)
            filled[id(param)] = filled.get(id(param), 0) + tensor.numel()
    filled.update(pieces.filled())
    missing = [n for n, p in model.named_parameters() if filled.get(id(p)) != expected[id(p)]]
    if missing:
        raise CheckpointError(f"{path}: weights missing or incomplete for {missing[:5]}")
    return num_bytes


def _place(name: str, dest: torch.Tensor, tensor: torch.Tensor, offset: int, dim: int) -> None:
    """Copy `tensor` into `dest` from `offset` along `dim`, if it fits there."""
    rows = tensor.shape[dim]
    others = [n for i, n in enumerate(tensor.shape) if i != dim]
    if (
        others != [n for i, n in enumerate(dest.shape) if i != dim]
        or offset + rows > dest.shape[dim]
    ):
        raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} does not fit the config")
    dest.narrow(dim, offset, rows).copy_(tensor)


def _read_parts(read: Callable[[Part], torch.Tensor], parts: list[Part]) -> torch.Tensor:
    """The spans of a tensor a rank reads (qwen3_next/sharded.py), joined along their dim."""
    if len(parts) == 1:
        return read(parts[0])
    return torch.cat([read(part) for part in parts], dim=parts[0][0])


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
    # an fp8 cache's scales (1.0 where the checkpoint has none); other caches ignore them
    scales = read_kv_scales(iter_slices(path), config.num_layers)
    for layer, (k_scale, v_scale) in zip(model.layers, scales, strict=True):
        layer.k_scale, layer.v_scale = k_scale, v_scale
    model = model.to(device).eval()
    model.build_matmuls()
    return model
