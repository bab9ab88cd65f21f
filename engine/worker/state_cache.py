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
snapshots (engine/kv/state_snapshots.py): as many as fit in SNAPSHOT_SHARE of the KV cache's
bytes, but at least one per sequence slot (no more state than the sequences' own), and at
most one per block.

Host rows (engine/kv/host_states.py) twin the state rows in host memory, as many as
HOST_STATE_SHARE of the CPU pool's bytes hold for swapped-out sequences (at most one per
sequence slot) and as many again for snapshots of prefix blocks on the CPU tier (at most one
per CPU block; with a disk tier, as many as the bytes hold). No CPU pool: no host rows, and
swap preemption recomputes. They are copied first of all in a step: device to host, then host
to device.
"""

import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.model.recurrent import RecurrentBatch, allocate_states
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import ScheduledStep

SNAPSHOT_SHARE = 0.25  # of the KV cache's bytes, at most, for prefix snapshots
HOST_STATE_SHARE = 0.25  # of the CPU pool's bytes, at most, for each use of host rows


def make_state_cache(
    config: ExecutorConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache: torch.Tensor,
    world_size: int = 1,
    cpu_cache: torch.Tensor | None = None,
) -> "StateCache | None":
    """A slot per sequence that can run at once (a fork finds one: engine/kv/state_slots.py);
    None for a model without recurrent layers. One of `world_size` tensor-parallel ranks
    holds its heads' share of each slot (as of the KV cache: the snapshot count is the same
    on every rank)."""
    if not model_config.num_recurrent_layers:
        return None
    if config.speculative_config is not None:
        # a rejected draft token would stay in the state: there is no rolling it back
        raise ConfigError("speculative_config: not with recurrent (Mamba2) layers")
    num_slots = config.max_num_seqs
    one = allocate_states(model_config, 1, dtype, "meta", world_size)
    slot_bytes = sum(t.numel() * t.element_size() for t in (one.conv, one.ssm))
    kv_bytes = kv_cache.numel() * kv_cache.element_size()
    by_bytes = max(int(SNAPSHOT_SHARE * kv_bytes) // slot_bytes, num_slots)
    num_snapshots = min(kv_cache.shape[2], by_bytes)
    states = allocate_states(model_config, num_slots + num_snapshots, dtype, device, world_size)
    cache = StateCache(states, num_slots, num_snapshots, slot_bytes)
    if cpu_cache is not None and cpu_cache.shape[2]:
        host_rows = _host_rows(config, num_slots, slot_bytes, cpu_cache)
        if sum(host_rows):
            cache.host = allocate_states(model_config, sum(host_rows), dtype, "cpu", world_size)
            cache.num_host_slots, cache.num_host_snapshot_slots = host_rows
    return cache


def _host_rows(
    config: ExecutorConfig, num_slots: int, slot_bytes: int, cpu_cache: torch.Tensor
) -> tuple[int, int]:
    """Host rows for swapped states and for lower tiers' snapshots (the module docstring)."""
    cpu_bytes = cpu_cache.numel() * cpu_cache.element_size()
    by_bytes = int(HOST_STATE_SHARE * cpu_bytes) // slot_bytes
    num_snapshots = by_bytes if config.kv_disk_dir else min(by_bytes, cpu_cache.shape[2])
    return min(by_bytes, num_slots), num_snapshots


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
