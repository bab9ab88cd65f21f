"""The executor's persistent request table and the per-step tensors built from it.

Each request the executor knows holds one row of `token_ids` and `block_table` (numpy, host
side) from its first step to its last; a step only applies deltas (new tokens, new block ids)
and then gathers its batch with vectorised indexing, never rebuilding tables from scratch.
A model with several KV groups (engine/kv/kv_groups.py) has one block table per group, and a
step one AttentionMetadata per group (its own slot mapping and tables). A sliding group's
NULL_BLOCK (-1) entries are stored as block 0: the kernels never read a block wholly outside
the window (the torch twin gathers it and masks it; its content is finite, another block's).
"""

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from kvpager.engine.model.attention import AttentionMetadata
from kvpager.engine.worker.prompt_logprobs import PromptSpan, prompt_spans
from kvpager.schemas.executor import CachedRequest, NewRequest
from kvpager.schemas.sampling import SamplingParams


@dataclass
class RequestState:
    seq_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # proposed tokens verified in this step; they sit in the row past num_tokens until then
    draft_token_ids: list[int] = field(default_factory=list)
    # a draft model's sampled proposals and the float32 [k, vocab] rows q they were drawn
    # from (spec_decode/rejection.py); None where proposals are greedy or rule-free
    draft_probs: tuple[list[int], torch.Tensor] | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata | tuple[AttentionMetadata, ...]  # one per KV group if several
    logits_indices: torch.Tensor  # int64 [num_sampled]: last token of each sampled sequence
    sampled_states: list[RequestState]  # requests that get a token this step, in that order
    # int64 [num_drafts]: the positions before each sampled sequence's last one that verify
    # its proposals, sequence by sequence; None without proposals
    draft_indices: torch.Tensor | None = None
    # rows asking for prompt logprobs that compute prompt positions in this step
    prompt_spans: list[PromptSpan] = field(default_factory=list)


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # KV groups 1..: their tables, [groups - 1, max_num_seqs, max_blocks]
        self.group_tables = np.zeros((num_groups - 1, max_num_seqs, max_blocks), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.states: dict[str, RequestState] = {}

    def add(self, new: NewRequest) -> RequestState:
        assert new.seq_id not in self.states, f"{new.seq_id} added twice"
        assert self.free_rows, "more live requests than max_num_seqs"
        row = self.free_rows.pop()
        num_tokens = len(new.token_ids)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.block_table[row, : len(new.block_ids)] = np.maximum(new.block_ids, 0)
        for table, ids in zip(self.group_tables, new.group_block_ids):
            table[row, : len(ids)] = np.maximum(ids, 0)  # NULL_BLOCK -> 0, never read
        state = RequestState(
            seq_id=new.seq_id,
            row=row,
            num_prompt_tokens=new.num_prompt_tokens,
            num_tokens=num_tokens,
            num_computed_tokens=new.num_computed_tokens,
            num_blocks=len(new.block_ids),
            params=new.sampling_params,
            output_token_ids=list(new.token_ids[new.num_prompt_tokens :]),
        )
        self.states[new.seq_id] = state
        return state

    def update(self, cached: CachedRequest) -> None:
        state = self.states[cached.seq_id]
        assert state.num_computed_tokens == cached.num_computed_tokens, (
            f"{cached.seq_id}: executor computed {state.num_computed_tokens} tokens, "
            f"scheduler says {cached.num_computed_tokens}"
        )
        end = cached.replace_from + len(cached.new_block_ids)
        if cached.new_block_ids:  # a swapped-in sliding table may hold NULL_BLOCK (-1)
            ids = np.maximum(cached.new_block_ids, 0)
            self.block_table[state.row, cached.replace_from : end] = ids
        for table, ids, start in zip(
            self.group_tables, cached.group_new_block_ids, cached.group_replace_from
        ):
            table[state.row, start : start + len(ids)] = np.maximum(ids, 0)
        state.num_blocks = max(state.num_blocks, end)
        drafts = cached.spec_token_ids
        self.token_ids[state.row, state.num_tokens : state.num_tokens + len(drafts)] = drafts
        state.draft_token_ids = list(drafts)

    def fork(
        self,
        parent_id: str,
        child_id: str,
        params: SamplingParams,
    ) -> RequestState:
        """A parallel sample: a copy of the parent's row and state, with its own sampling."""
        parent = self.states[parent_id]
        assert child_id not in self.states, f"{child_id} forked twice"
        row = self.free_rows.pop()
        self.token_ids[row, : parent.num_tokens] = self.token_ids[parent.row, : parent.num_tokens]
        self.block_table[row, : parent.num_blocks] = self.block_table[
            parent.row, : parent.num_blocks
        ]
        self.group_tables[:, row, : parent.num_blocks] = self.group_tables[
            :, parent.row, : parent.num_blocks
        ]
        child = dataclasses.replace(
            parent,
            seq_id=child_id,
            row=row,
            params=params,
            output_token_ids=list(parent.output_token_ids),
            draft_token_ids=[],
            draft_probs=None,
        )
        self.states[child_id] = child
        return child

    def remove(self, seq_id: str) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    def append_token(self, state: RequestState, token_id: int) -> None:
        self.token_ids[state.row, state.num_tokens] = token_id
        state.num_tokens += 1
        state.output_token_ids.append(token_id)

    def accept(self, state: RequestState, token_ids: list[int]) -> None:
        """The tokens one step emitted for `state`; with proposals verified, the computed
        count rolls back past the rejected ones (their K/V is overwritten later) and the
        table forgets blocks that only they had reached, as the scheduler's does."""
        num_rejected = len(state.draft_token_ids) + 1 - len(token_ids)
        assert num_rejected >= 0, f"{state.seq_id}: more tokens than positions verified"
        for token_id in token_ids:
            self.append_token(state, token_id)
        if state.draft_token_ids:
            state.num_computed_tokens -= num_rejected
            num_blocks = -(-state.num_computed_tokens // self.block_size)
            state.num_blocks = min(state.num_blocks, num_blocks)
            state.draft_token_ids = []

    @staticmethod
    def seed_position(state: RequestState) -> int:
        """The output position of the token `state` samples next, earlier runs included."""
        return state.params.seed_offset + len(state.output_token_ids)

    def prompt_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, : state.num_prompt_tokens].tolist()

    def prepare(self, num_scheduled: dict[str, int]) -> StepInputs:
        """Gather the flat batch of this step's tokens from the persistent tables."""
        states = [self.states[seq_id] for seq_id in num_scheduled]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=len(states))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        cu_seqlens = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        seq_of_token = np.repeat(np.arange(len(states)), counts)
        positions = starts[seq_of_token] + np.arange(cu_seqlens[-1]) - cu_seqlens[seq_of_token]
        token_rows = rows[seq_of_token]
        input_ids = self.token_ids[token_rows, positions]
        block_idx, offsets = positions // self.block_size, positions % self.block_size
        block_ids = self.block_table[token_rows, block_idx].astype(np.int64)
        slot_mapping = block_ids * self.block_size + offsets
        seq_lens = starts + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        ends = [s.num_tokens + len(s.draft_token_ids) for s in states]
        sampled = [i for i, s in enumerate(states) if seq_lens[i] == ends[i]]
        spans = prompt_spans(states, starts, counts, cu_seqlens)
        for state, count in zip(states, counts.tolist()):
            state.num_computed_tokens += count
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            block_tables=self._to_device(self.block_table[rows, :max_blocks]),
            cu_seqlens_q=self._to_device(cu_seqlens.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            max_seqlen_q=int(counts.max()),
        )
        if len(self.group_tables):
            meta = (meta,) + tuple(
                dataclasses.replace(
                    meta,
                    slot_mapping=self._to_device(
                        table[token_rows, block_idx].astype(np.int64) * self.block_size + offsets
                    ),
                    block_tables=self._to_device(table[rows, :max_blocks]),
                )
                for table in self.group_tables
            )
        return StepInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            meta=meta,
            logits_indices=self._to_device(cu_seqlens[1:][sampled] - 1),
            sampled_states=[states[i] for i in sampled],
            draft_indices=self._draft_indices(states, sampled, cu_seqlens),
            prompt_spans=spans,
        )

    def prompt_counts(self, num_scheduled: dict[str, int]) -> list[int]:
        """Per scheduled sequence, how many of this step's tokens are prompt tokens; after
        `prepare`, which moved each one's computed count past them."""
        counts = []
        for seq_id, count in num_scheduled.items():
            state = self.states[seq_id]
            start = state.num_computed_tokens - count
            counts.append(min(max(state.num_prompt_tokens - start, 0), count))
        return counts

    def _draft_indices(self, states, sampled: list[int], cu_seqlens) -> torch.Tensor | None:
        lasts = [(int(cu_seqlens[i + 1]) - 1, len(states[i].draft_token_ids)) for i in sampled]
        indices = [last - num + j for last, num in lasts for j in range(num)]
        return self._to_device(np.asarray(indices, dtype=np.int64)) if indices else None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
