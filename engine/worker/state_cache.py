"""The executor's side of recurrent state slots: it owns the state tensors
(engine/model/recurrent.py: one kind's, RecurrentStates for Mamba2) and applies what a step
says about them, by id alone (engine/kv/state_slots.py decides; ScheduledStep carries the ids,
StepCheck checked them).

Per step, around the forward pass: zero the slots new to a sequence, restore those resuming a
prefix hit from their snapshot and copy the state of each fork applied before the pass (a beam
chosen twice); run the mixers on each scheduled sequence's slot, copying the state out into
snapshot slots at the block boundaries the step names; after the pass copy the state of each
fork that samples (a parallel sample forked as its parent's prompt completes: the state then
holds the whole prompt).

Rows 0..num_slots-1 are the sequences'; the `num_snapshot_slots` rows past them hold prefix
snapshots (engine/kv/state_snapshots.py). How many of each there are comes out of the KV
cache's own budget (engine/kv/state_pool.py: the executor carves them out before sizing the
blocks), as do the host rows (engine/kv/host_states.py) out of the CPU pool's swap bytes:
rows for swapped-out sequences, then rows for snapshots of prefix blocks on lower tiers. No
host rows: swap preemption recomputes. They are copied first of all in a step: device to
host, then host to device.
"""

import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.state_pool import PoolSplit
from kvpager.engine.model.recurrent import RecurrentBatch, allocate_states
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import ScheduledStep


def state_slot_bytes(
    config: ExecutorConfig, model_config: ModelConfig, dtype: torch.dtype, world_size: int = 1
) -> int:
    """One state row's bytes (every recurrent layer's, one rank's heads); 0 without
    recurrent layers. Refuses what recurrent layers cannot run with."""
    if not model_config.num_recurrent_layers:
        return 0
    if config.speculative_config is not None:
        # a rejected draft token would stay in the state: there is no rolling it back
        raise ConfigError("speculative_config: not with recurrent (Mamba2) layers")
    one = allocate_states(model_config, 1, dtype, "meta", world_size)
    return sum(t.numel() * t.element_size() for t in (one.conv, one.ssm))


def make_state_cache(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    split: PoolSplit,
    host: PoolSplit,
    world_size: int = 1,
) -> "StateCache | None":
    """The state rows `split` and `host` carved out of the device and CPU pools (a fork finds
    a slot: the scheduler runs at most `num_slots` sequences); None for a model without
    recurrent layers. One of `world_size` tensor-parallel ranks holds its heads' share of
    each row (the counts are the same on every rank)."""
    if not model_config.num_recurrent_layers:
        return None
    num_rows = split.num_slots + split.num_snapshots
    states = allocate_states(model_config, num_rows, dtype, device, world_size)
    cache = StateCache(states, split.num_slots, split.num_snapshots, split.slot_bytes)
    if host.num_blocks and host.num_slots + host.num_snapshots:  # no CPU pool: no host rows
        num_host = host.num_slots + host.num_snapshots
        cache.host = allocate_states(model_config, num_host, dtype, "cpu", world_size)
        cache.num_host_slots, cache.num_host_snapshot_slots = host.num_slots, host.num_snapshots
    return cache


def copy_rows(source, destination, pairs: list[tuple[int, int]]) -> None:
    """(source row, destination row) of every recurrent layer's states, across devices."""
    rows_from = [src for src, _ in pairs]
    rows_to = [dst for _, dst in pairs]
    for src, dst in ((source.conv, destination.conv), (source.ssm, destination.ssm)):
        dst[:, rows_to] = src[:, rows_from].to(dst.device)


class StateCache:
    def __init__(
        self, states, num_slots: int = 0, num_snapshot_slots: int = 0, slot_bytes: int = 0
    ) -> None:
        """`num_slots` 0: every row of `states` is a sequence's."""
        self.states = states
        self.num_slots = num_slots or states.conv.shape[1] - num_snapshot_slots
        self.num_snapshot_slots = num_snapshot_slots
        self.slot_bytes = slot_bytes  # one row of every recurrent layer
        self.host = None  # host rows (make_state_cache), the same states' kind
        self.num_host_slots = self.num_host_snapshot_slots = 0

    def before_forward(self, step: ScheduledStep) -> None:
        if step.state_to_host:  # first: a slot swapped out may be reused in this step
            copy_rows(self.states, self.host, step.state_to_host)
        if step.state_from_host:
            copy_rows(self.host, self.states, step.state_from_host)
        if step.state_resets:
            self.states.reset(step.state_resets)
        if step.state_restores:
            self.states.copy(step.state_restores)
        self._copy_forks(step, sample=False)

    def after_forward(self, step: ScheduledStep) -> None:
        self._copy_forks(step, sample=True)

    def batch(self, step: ScheduledStep, prompt_counts: list[int] | None = None) -> RecurrentBatch:
        """The step's sequences' token counts and slots, in the batch's order; `prompt_counts`:
        how many of each one's tokens are prompt tokens (InputBatch.prompt_counts)."""
        rows = {seq_id: i for i, seq_id in enumerate(step.num_scheduled_tokens)}
        cuts: list[list[tuple[int, int]]] = [[] for _ in rows]
        for seq_id, offset, snapshot in step.state_snapshots:
            cuts[rows[seq_id]].append((offset, snapshot))
        return RecurrentBatch(
            self.states,
            list(step.num_scheduled_tokens.values()),
            self.slots(step),
            cuts,
            prompt_counts,
        )

    @staticmethod
    def slots(step: ScheduledStep) -> list[int]:
        """The scheduled sequences' slots, in the step's order (the batch's rows)."""
        return [step.state_slots[seq_id] for seq_id in step.num_scheduled_tokens]

    def _copy_forks(self, step: ScheduledStep, sample: bool) -> None:
        slots = step.state_slots
        pairs = [
            (slots[fork.parent_id], slots[fork.child_id])
            for fork in step.forks
            if fork.sample == sample and fork.parent_id in slots
        ]
        if pairs:
            self.states.copy(pairs)
