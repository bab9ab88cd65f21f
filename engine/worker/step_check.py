"""The executor's check of a step against its own capacity, before anything is applied.

The scheduler owns the block ids, but a step comes over the wire: an id past the cache would
make a kernel write into another request's blocks, or outside the cache. `StepCheck.check`
walks the step in the order the executor applies it (forks to copy, finished, new, cached,
the scheduled tokens, forks that sample) over a shadow of the request table, so a bad step is
refused whole and the executor's state stays as it was. Ranges are checked once per step over
every id at once (numpy), the rest is a few integer comparisons per request.
"""

from dataclasses import dataclass

import numpy as np
from kvpager.engine.kv.kv_groups import num_skipped_blocks
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.executor import CachedRequest, NewRequest, ScheduledStep


@dataclass(frozen=True)
class Capacity:
    """What the executor holds; every id and count in a step must fit inside it."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    # per KV group (engine/kv/kv_groups.py): its window, 0 = full; each group has its own
    # table per request
    group_windows: tuple[int, ...] = (0,)
    num_state_slots: int = 0  # recurrent layers' per-sequence state slots (0: none)
    num_snapshot_slots: int = 0  # the state rows past those: prefix snapshots
    num_host_state_slots: int = 0  # host rows for swapped states (engine/kv/host_states.py)
    num_host_snapshot_slots: int = 0  # host rows past those: lower tiers' snapshots

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass
class _Row:
    """The shadow of one request's row while the check walks a step."""

    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_drafts: int = 0  # proposals after num_tokens, verified this step


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidStepError(message)


def _in_range(values: list[int], limit: int, what: str, low: int = 0) -> None:
    """Every value in [low, limit): one vectorised pass (steps carry up to thousands of ids)."""
    if values:
        array = np.asarray(values, dtype=np.int64)
        ok = low <= int(array.min()) and int(array.max()) < limit
        _require(ok, f"{what} outside [{low}, {limit})")


class StepCheck:
    """Checks steps for one executor; `check(step, batch)` raises InvalidStepError or returns."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity

    def check(self, step: ScheduledStep, batch: InputBatch) -> None:
        self._check_ranges(step)
        shadow = _Shadow(batch)
        for fork in step.forks:
            if not fork.sample:
                shadow.fork(fork.parent_id, fork.child_id)
        for seq_id in step.finished_seq_ids:
            shadow.remove(seq_id)
        for new in step.new_requests:
            self._check_new(new, shadow)
        for cached in step.cached_requests:
            self._check_cached(cached, shadow)
            unverified = cached.spec_token_ids and cached.seq_id not in step.num_scheduled_tokens
            _require(not unverified, f"proposals of {cached.seq_id!r}: not scheduled")
        sampled = self._check_scheduled(step.num_scheduled_tokens, shadow)
        for fork in step.forks:
            if fork.sample:
                _require(fork.parent_id in sampled, f"fork of {fork.parent_id!r}: not sampled")
                shadow.fork(fork.parent_id, fork.child_id)
                sampled.add(fork.child_id)
        for seq_id, k in step.num_spec_tokens.items():
            _require(seq_id in sampled and 0 <= k <= 64, f"proposals for {seq_id!r}: {k}")

    def _check_ranges(self, step: ScheduledStep) -> None:
        """Every block id, token id and block pair of the step, at once."""
        cap = self.capacity
        # tables may hold NULL_BLOCK (-1): a sliding group's block slid out of its window
        table_ids = [b for new in step.new_requests for b in new.block_ids]
        table_ids += [b for cached in step.cached_requests for b in cached.new_block_ids]
        table_ids += [b for new in step.new_requests for ids in new.group_block_ids for b in ids]
        table_ids += [
            b for cached in step.cached_requests for ids in cached.group_new_block_ids for b in ids
        ]
        _in_range(table_ids, cap.num_blocks, "block ids", low=-1)
        device_ids = [b for pair in step.blocks_to_copy for b in pair]
        device_ids += [pair[0] for pair in step.blocks_to_swap_out]
        device_ids += [pair[1] for pair in step.blocks_to_swap_in]
        device_ids += [block.block_id for block in step.blocks_to_disk if block.on_device]
        _in_range(device_ids, cap.num_blocks, "block ids")
        cpu_ids = [pair[1] for pair in step.blocks_to_swap_out]
        cpu_ids += [pair[0] for pair in step.blocks_to_swap_in]
        disk_blocks = step.blocks_to_disk + step.blocks_from_disk
        cpu_ids += [block.block_id for block in disk_blocks if not block.on_device]
        _in_range(cpu_ids, cap.num_cpu_blocks, "cpu block ids")
        for block in disk_blocks:
            _require(len(block.block_hash) == 32, "disk block: a hash is not 32 bytes")
            _require(len(block.token_ids) == cap.block_size, "disk block: not a full block")
        _require(not any(b.on_device for b in step.blocks_from_disk), "disk read into the device")
        token_ids = [t for new in step.new_requests for t in new.token_ids]
        token_ids += [t for cached in step.cached_requests for t in cached.new_token_ids]
        token_ids += [t for cached in step.cached_requests for t in cached.spec_token_ids]
        token_ids += [t for block in disk_blocks for t in block.token_ids]
        _in_range(token_ids, cap.vocab_size, "token ids")
        self._check_state(step)

    def _check_state(self, step: ScheduledStep) -> None:
        """State slot ids inside the executor's slots, for scheduled sequences and fork
        children only, never two sequences in one; a fork with a parent's slot names its
        child's too (the copy's destination), which is not also zeroed."""
        owners = step.state_slots
        _in_range(
            [*owners.values(), *step.state_resets], self.capacity.num_state_slots, "state slots"
        )
        children = {fork.child_id for fork in step.forks}
        known = owners.keys() <= step.num_scheduled_tokens.keys() | children
        if self.capacity.num_state_slots:  # every scheduled sequence's mixers read its slot
            missing = step.num_scheduled_tokens.keys() - owners.keys()
            _require(not missing, f"state slot: none for {sorted(missing)[:3]}")
        _require(known, "state slot: for a sequence neither scheduled nor forked")
        _require(len(set(owners.values())) == len(owners), "state slot: two sequences in one")
        for fork in step.forks:
            if fork.parent_id in owners:
                _require(fork.child_id in owners, f"state slot: none for {fork.child_id!r}")
        copied = {owners[child] for child in children if child in owners}
        resets = step.state_resets
        _require(len(set(resets)) == len(resets), "state slot: zeroed twice in a step")
        _require(not copied & set(resets), "state slot: a fork's copy also zeroed")
        self._check_snapshots(step)

    def _check_snapshots(self, step: ScheduledStep) -> None:
        """Restores copy a snapshot row into a scheduled sequence's slot that is not zeroed;
        snapshots name a scheduled sequence, an offset inside its step tokens and a snapshot
        row, each row written once."""
        cap = self.capacity
        first, end = cap.num_state_slots, cap.num_state_slots + cap.num_snapshot_slots
        owned = set(step.state_slots.values()) - set(step.state_resets)
        for source, slot in step.state_restores:
            _require(first <= source < end, f"state restore: {source} is no snapshot slot")
            _require(slot in owned, f"state restore: slot {slot} is no sequence's")
        written = [slot for _, _, slot in step.state_snapshots]
        _require(len(set(written)) == len(written), "state snapshot: a slot written twice")
        for seq_id, offset, slot in step.state_snapshots:
            num_tokens = step.num_scheduled_tokens.get(seq_id, 0)
            _require(0 < offset <= num_tokens, f"state snapshot: offset {offset} of {seq_id!r}")
            _require(first <= slot < end, f"state snapshot: {slot} is no snapshot slot")
        self._check_host_rows(step, owned - {slot for _, slot in step.state_restores})

    def _check_host_rows(self, step: ScheduledStep, owned: set[int]) -> None:
        """Host rows inside the executor's; copies to the host write each row once, from any
        state row; copies back read rows this step did not write, into scheduled sequences'
        slots that nothing else fills."""
        cap = self.capacity
        num_host = cap.num_host_state_slots + cap.num_host_snapshot_slots
        num_rows = cap.num_state_slots + cap.num_snapshot_slots
        to_host, from_host = step.state_to_host, step.state_from_host
        _in_range([row for row, _ in to_host], num_rows, "state rows to the host")
        host_rows = [row for _, row in to_host] + [row for row, _ in from_host]
        _in_range(host_rows, num_host, "host state rows")
        written = {row for _, row in to_host}
        _require(len(written) == len(to_host), "host state row: written twice in a step")
        _require(not written & {row for row, _ in from_host}, "host state row: read as written")
        slots = [slot for _, slot in from_host]
        _require(len(set(slots)) == len(slots), "state slot: filled twice from the host")
        _require(set(slots) <= owned, "state slot from the host: no scheduled sequence's")

    def _check_new(self, new: NewRequest, shadow: "_Shadow") -> None:
        cap, num_tokens = self.capacity, len(new.token_ids)
        name = f"new request {new.seq_id!r}"
        _require(1 <= num_tokens <= cap.max_model_len, f"{name}: {num_tokens} tokens")
        _require(0 <= new.num_prompt_tokens <= num_tokens, f"{name}: num_prompt_tokens")
        _require(0 <= new.num_computed_tokens <= num_tokens, f"{name}: num_computed_tokens")
        _require(len(new.block_ids) <= cap.max_blocks_per_seq, f"{name}: too many blocks")
        _require(
            len(new.group_block_ids) == cap.num_groups - 1
            and all(len(ids) == len(new.block_ids) for ids in new.group_block_ids),
            f"{name}: one table per KV group ({cap.num_groups}), all of one length",
        )
        for window, ids in zip(cap.group_windows, [new.block_ids, *new.group_block_ids]):
            self._check_nulls(ids, 0, window, new.num_computed_tokens, name)
        shadow.add(new.seq_id, _Row(num_tokens, new.num_computed_tokens, len(new.block_ids)))

    def _check_cached(self, cached: CachedRequest, shadow: "_Shadow") -> None:
        row, cap = shadow.get(cached.seq_id), self.capacity
        name = f"cached request {cached.seq_id!r}"
        _require(
            cached.num_computed_tokens == row.num_computed_tokens,
            f"{name}: {cached.num_computed_tokens} computed tokens, the executor has "
            f"{row.num_computed_tokens}",
        )
        end = cached.replace_from + len(cached.new_block_ids)
        _require(0 <= cached.replace_from <= row.num_blocks, f"{name}: replace_from")
        _require(end <= cap.max_blocks_per_seq, f"{name}: too many blocks")
        self._check_group_deltas(cached, row, end, name)
        num_tokens = row.num_tokens + len(cached.new_token_ids)
        num_drafts = len(cached.spec_token_ids)
        _require(
            num_tokens + num_drafts <= cap.max_model_len, f"{name}: more than max_model_len tokens"
        )
        shadow.put(
            cached.seq_id,
            _Row(num_tokens, row.num_computed_tokens, max(row.num_blocks, end), num_drafts),
        )

    def _check_group_deltas(self, cached: CachedRequest, row: "_Row", end: int, name: str) -> None:
        """Every other KV group's table changes alike: its replaced range ends where group
        0's does (they cover the same tokens)."""
        groups = list(zip(cached.group_new_block_ids, cached.group_replace_from))
        _require(
            len(cached.group_new_block_ids) == len(cached.group_replace_from)
            and len(groups) == self.capacity.num_groups - 1,
            f"{name}: group deltas for {self.capacity.num_groups} KV groups",
        )
        for ids, start in groups:
            _require(0 <= start <= row.num_blocks, f"{name}: group replace_from")
            _require(start + len(ids) == end, f"{name}: KV groups' tables of unequal length")
        deltas = [(cached.new_block_ids, cached.replace_from), *groups]
        for window, (ids, start) in zip(self.capacity.group_windows, deltas):
            self._check_nulls(ids, start, window, row.num_computed_tokens, name)

    def _check_nulls(
        self, ids: list[int], start: int, window: int, num_computed: int, name: str
    ) -> None:
        """NULL_BLOCK (-1) only in a sliding group, only before the window of the next token
        to compute: a block no token of this step is written to or read from."""
        if -1 not in ids:
            return
        block_size = self.capacity.block_size
        num_skipped = num_skipped_blocks(num_computed, window, block_size)
        last_null = start + max(i for i, block_id in enumerate(ids) if block_id == -1)
        _require(last_null < num_skipped, f"{name}: a null block inside the attended context")

    def _check_scheduled(self, num_scheduled: dict[str, int], shadow: "_Shadow") -> set[str]:
        """The tokens to compute lie inside each row's known tokens and blocks; returns who
        samples (their next token must fit in the row)."""
        block_size, sampled = self.capacity.block_size, set()
        for seq_id, count in num_scheduled.items():
            row = shadow.get(seq_id)
            end = row.num_computed_tokens + count
            name = f"scheduled request {seq_id!r}"
            last = row.num_tokens + row.num_drafts  # proposals are verified all at once
            _require(1 <= count and end <= last, f"{name}: {count} tokens to compute")
            _require(not row.num_drafts or end == last, f"{name}: proposals left unverified")
            _require(-(-end // block_size) <= row.num_blocks, f"{name}: tokens past its blocks")
            if end == last:
                _require(last < self.capacity.max_model_len, f"{name}: row is full")
                sampled.add(seq_id)
            shadow.put(seq_id, _Row(row.num_tokens, end, row.num_blocks))
        return sampled


class _Shadow:
    """The request table as the step would leave it, over the batch, without touching it."""

    def __init__(self, batch: InputBatch) -> None:
        self._batch = batch
        self._rows: dict[str, _Row | None] = {}  # None: removed by this step
        self.num_free_rows = len(batch.free_rows)

    def find(self, seq_id: str) -> _Row | None:
        if seq_id in self._rows:
            return self._rows[seq_id]
        state = self._batch.states.get(seq_id)
        if state is None:
            return None
        return _Row(state.num_tokens, state.num_computed_tokens, state.num_blocks)

    def get(self, seq_id: str) -> _Row:
        row = self.find(seq_id)
        _require(row is not None, f"unknown request {seq_id!r}")
        return row

    def put(self, seq_id: str, row: _Row) -> None:
        self._rows[seq_id] = row

    def add(self, seq_id: str, row: _Row) -> None:
        _require(self.find(seq_id) is None, f"request {seq_id!r} added twice")
        _require(self.num_free_rows > 0, "more requests than max_num_seqs")
        self.num_free_rows -= 1
        self._rows[seq_id] = row

    def fork(self, parent_id: str, child_id: str) -> None:
        parent = self.get(parent_id)
        self.add(child_id, _Row(parent.num_tokens, parent.num_computed_tokens, parent.num_blocks))

    def remove(self, seq_id: str) -> None:
        if self.find(seq_id) is not None:
            self.num_free_rows += 1
            self._rows[seq_id] = None
