"""Recurrent layers' mixers by kind, in one place: what a layer builds, what state tensors the
executor allocates for them and how a layer runs on its slice of those states.

A kind (ModelConfig.recurrent_mixer) names a `MixerKind`: "mamba2" (Granite 4's Mamba2,
engine/model/mamba2.py) and "gated_deltanet" (Qwen3-Next's, engine/model/qwen3_next/); another
mixer with per-sequence state adds its entry to MIXERS with the same three functions. The
states follow RecurrentStates' interface: rows are slots, `reset(slots)` and `copy(pairs)`
(engine/worker/state_cache.py applies them).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from kvpager.engine.model.mamba2 import Mamba2Mixer, RecurrentStates
from kvpager.engine.model.qwen3_next import gated_deltanet
from kvpager.engine.model.qwen3_next.layer_pieces import run_deltanet
from kvpager.engine.model.sharding import Mamba2Shard, Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import CheckpointError


@dataclass
class RecurrentBatch:
    """A step's view of the states: each scheduled sequence's token count and slot, in the
    batch's order (the rows of the flat batch, back to back)."""

    states: Any  # RecurrentStates, or another kind's with its interface
    seq_lens: list[int]
    slots: list[int]
    # per sequence: (offset in its tokens, snapshot slot), ascending; the state after that
    # many of its tokens is copied into the snapshot slot (engine/kv/state_snapshots.py)
    cuts: list[list[tuple[int, int]]] | None = None
    # per sequence: how many of its tokens this step are prompt tokens (the rest are outputs,
    # or a recomputed sequence's outputs): Mamba2 clamps dt to time_step_limit on those alone,
    # as transformers does in the prompt's chunked scan and never in a decode step
    prompt_counts: list[int] | None = None

    def layer(self, state_idx: int) -> "RecurrentLayerCache":
        return RecurrentLayerCache(self, state_idx)


class RecurrentLayerCache(NamedTuple):
    """What a recurrent layer reads in place of its K/V slot: the batch and its own layer
    index among the recurrent layers (the states' first dim)."""

    batch: RecurrentBatch
    state_idx: int


class MixerKind(NamedTuple):
    # (config, dtype, the rank's Shard, its TensorParallel group or None)
    build: Callable[[ModelConfig, torch.dtype, Shard, Any], torch.nn.Module]
    # (config, slots, dtype, device, world size): a rank's states hold only its heads'
    allocate: Callable[[ModelConfig, int, torch.dtype, torch.device, int], Any]
    run: Callable[[torch.nn.Module, torch.Tensor, RecurrentLayerCache], torch.Tensor]


def _build_mamba2(config: ModelConfig, dtype: torch.dtype, shard: Shard, group) -> Mamba2Mixer:
    dims = config.mamba_dims
    mixer_shard = Mamba2Shard(dims, shard.rank, shard.world_size)
    return Mamba2Mixer(
        dims, dtype, config.mamba_proj_bias, config.mamba_conv_bias, mixer_shard, group
    )


def _allocate_mamba2(
    config: ModelConfig, num_slots: int, dtype, device, world_size: int = 1
) -> RecurrentStates:
    dims = config.mamba_dims.per_rank(world_size)
    return RecurrentStates.allocate(dims, config.num_recurrent_layers, num_slots, dtype, device)


def _run_mamba2(mixer, hidden: torch.Tensor, cache: RecurrentLayerCache) -> torch.Tensor:
    batch, idx = cache.batch, cache.state_idx
    conv, ssm = batch.states.conv[idx], batch.states.ssm[idx]
    return mixer(hidden, batch.seq_lens, batch.slots, conv, ssm, batch.cuts, batch.prompt_counts)


MIXERS: dict[str, MixerKind] = {
    "mamba2": MixerKind(_build_mamba2, _allocate_mamba2, _run_mamba2),
    # Qwen3-Next's gated DeltaNet (engine/model/qwen3_next/): the same states' interface
    "gated_deltanet": MixerKind(
        lambda c, dt, shard, group: gated_deltanet.GatedDeltaNet(
            c.deltanet_dims.per_rank(shard.world_size), dt
        ),
        lambda c, n, dt, dev, world_size=1: gated_deltanet.allocate_states(
            c.deltanet_dims.per_rank(world_size), c.num_recurrent_layers, n, dt, dev
        ),
        run_deltanet,
    ),
}


def mixer_kind(config: ModelConfig) -> MixerKind:
    if config.recurrent_mixer not in MIXERS:
        raise CheckpointError(f"recurrent mixer {config.recurrent_mixer!r} is not supported")
    return MIXERS[config.recurrent_mixer]


def allocate_states(
    config: ModelConfig, num_slots: int, dtype: torch.dtype, device, world_size: int = 1
) -> Any:
    """Every recurrent layer's states for `num_slots` sequences (one of `world_size` ranks'
    share of them); None for other models."""
    if not config.num_recurrent_layers:
        return None
    return mixer_kind(config).allocate(config, num_slots, dtype, device, world_size)


def state_indices(config: ModelConfig) -> list[int]:
    """Per layer: its index among the recurrent layers (-1 for attention layers)."""
    indices, count = [], 0
    for layer_idx in range(config.num_layers):
        indices.append(count if config.is_recurrent(layer_idx) else -1)
        count += config.is_recurrent(layer_idx)
    return indices
