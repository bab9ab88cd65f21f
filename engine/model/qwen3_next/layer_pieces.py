"""How the one decoder (engine/model/decoder.py) takes Qwen3-Next's pieces: which a layer
builds (gated attention for the `full_attention` layers, the shared-expert MoE for the MoE
layers; the DeltaNet mixer comes through engine/model/recurrent.py's MIXERS), how the loader
hands each piece its checkpoint tensors (each piece's `load_tensor` knows its names and
layouts), and how a DeltaNet layer runs a step with prefix snapshots (the cuts).
"""

import torch
from kvpager.engine.model.qwen3_next.gated_attention import GatedAttention
from kvpager.engine.model.qwen3_next.gated_deltanet import GatedDeltaNet
from kvpager.engine.model.qwen3_next.shared_expert_moe import SharedExpertMoe
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from torch import nn


def build_pieces(
    config: ModelConfig, layer_idx: int, dtype: torch.dtype, shard: Shard
) -> tuple[GatedAttention | None, SharedExpertMoe | None]:
    """The layer's gated attention (a full-attention layer of a gated model) and its
    shared-expert MoE (a MoE layer with a gated shared expert), at the rank's `shard` of the
    heads and intermediate rows (sharded.py); None where it has neither."""
    attention = None
    if config.attn_output_gate and not config.is_recurrent(layer_idx):
        attention = GatedAttention(
            config.hidden_size, shard.num_heads, shard.num_kv_heads, config.head_dim,
            config.rms_norm_eps, dtype, config.attention_bias, adds_o_bias=shard.rank == 0,
        )  # fmt: skip
    moe = None
    if config.shared_expert_gate and config.is_sparse(layer_idx):
        moe = SharedExpertMoe(
            config, shard.shared_expert_intermediate_size, dtype, shard.expert_intermediate_size
        )
    return attention, moe


def piece_tensor(layers: nn.ModuleList, name: str) -> tuple[nn.Module, str] | None:
    """(the piece, its name for the tensor) where a checkpoint tensor belongs to a piece:
    `layers.<i>.linear_attn.*` a DeltaNet mixer's, `self_attn.*` a gated attention's, `mlp.*`
    a shared-expert MoE's; None for every other tensor (the loader's own targets)."""
    name = name.removeprefix("model.")
    if not name.startswith("layers."):
        return None
    _, idx, rest = name.split(".", 2)
    group, _, kind = rest.partition(".")
    if not idx.isdigit() or int(idx) >= len(layers):
        return None
    layer = layers[int(idx)]
    mixer = layer.mixer if isinstance(layer.mixer, GatedDeltaNet) else None
    piece = {"linear_attn": mixer, "self_attn": layer.gated_attn, "mlp": layer.moe_block}
    return None if piece.get(group) is None else (piece[group], kind)


class PieceFill:
    """The elements each piece took, so the loader can tell a piece whose every parameter
    was filled from one missing a tensor."""

    def __init__(self) -> None:
        self.loaded: dict[int, tuple[nn.Module, int]] = {}

    def load(self, piece: nn.Module, kind: str, tensor: torch.Tensor) -> None:
        piece.load_tensor(kind, tensor)
        _, count = self.loaded.get(id(piece), (piece, 0))
        self.loaded[id(piece)] = (piece, count + tensor.numel())

    def filled(self) -> dict[int, int]:
        """{id(parameter): its elements} of every piece whose parameters were all filled."""
        done = {}
        for piece, count in self.loaded.values():
            params = list(piece.parameters())
            if count == sum(p.numel() for p in params):
                done.update({id(p): p.numel() for p in params})
        return done


def run_deltanet(mixer: GatedDeltaNet, hidden: torch.Tensor, cache) -> torch.Tensor:
    """A DeltaNet layer's step on its RecurrentLayerCache (engine/model/recurrent.py). With
    prefix snapshots to take (`cuts`), each sequence runs alone, in pieces ending at its cuts,
    each piece's state copied into its snapshot slots (as the Mamba2 mixer cuts its scan)."""
    batch, idx = cache.batch, cache.state_idx
    conv, rule = batch.states.conv[idx], batch.states.ssm[idx]
    if not batch.cuts or not any(batch.cuts):
        return mixer(hidden, batch.seq_lens, batch.slots, conv, rule)
    out, start = torch.empty_like(hidden), 0
    for n, slot, cuts in zip(batch.seq_lens, batch.slots, batch.cuts):
        ends = sorted({offset for offset, _ in cuts if 0 < offset < n} | {n})
        for lo, hi in zip([0, *ends[:-1]], ends):
            rows = slice(start + lo, start + hi)
            out[rows] = mixer(hidden[rows], [hi - lo], [slot], conv, rule)
            for copy in [s for offset, s in cuts if offset == hi or n == 1]:
                conv[copy], rule[copy] = conv[slot], rule[slot]
        start += n
    return out
