"""Draft-model speculation: a smaller decoder of the same vocabulary proposes k tokens.

The draft is a second `Decoder` on the executor. Its K/V lives in the same paged pool as the
target's: the cache tensor holds `num_layers(draft)` more layer slots after the target's
(engine/worker/kv_cache.py), so every block id the scheduler hands a request carries the
draft's K/V too, in the same block table. The scheduler therefore counts the draft's blocks
at admission, and frees them at finish, abort and preemption, with nothing new to track;
swap-out, swap-in and block copies move the draft's slots with the target's. The memory a
block takes grows by the draft's share, so fewer blocks fit (engine/memory.py).

Each step, for the requests it asks (engine/sched/lookahead.py), the proposer
1. catches the draft's cache up on the tokens it has not computed yet (the whole prompt the
   first time, then the last step's accepted tokens and the model's own token), in one
   batched forward of chunks, and takes the argmax after the last as the first proposal;
2. feeds each proposal back, one batched forward per further proposal, up to each
   request's k.

Which draft K/V survives: the scheduler keeps only the blocks of a request's computed tokens
(rejected proposals' lookahead blocks are trimmed), so only the draft's positions below the
target's computed count are kept; the rest are recomputed next step. The positions past the
request's blocks that step 2 writes (at most k, so `ceil(k / block_size)` blocks a request)
go to scratch blocks the executor keeps out of the scheduler's pool. Stale or foreign draft
K/V can only make proposals worse: verification (verify.py) decides every emitted token.

Which token it proposes: on random rows without a seed or logprobs, a draw from q, its
softmax at the row's temperature, verified by the standard speculative-sampling rule with q
(spec_decode/rejection.py: accept with min(1, p / q), else draw from norm(max(0, p - q)));
elsewhere its greedy token, a one-hot q, for which that rule is verify.py's exactly (greedy
outputs equal plain decoding, seeded rows the same tokens as without speculation). Either way
the outputs keep the target's distribution.
"""

from pathlib import Path

import numpy as np
import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.kv_groups import KvGroups
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_model
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.worker.input_batch import InputBatch, RequestState
from kvpager.engine.worker.spec_decode.rejection import samples_drafts
from kvpager.kernels.backend import KernelOps
from kvpager.schemas.errors import ConfigError

_SAME_SHAPE = ("vocab_size", "num_heads", "num_kv_heads", "cache_head_dim")


def load_draft(
    config: ExecutorConfig,
    target: ModelConfig,
    kv_groups: KvGroups,
    dtype: torch.dtype,
    device: torch.device,
    ops: KernelOps,
    world_size: int,
) -> Decoder | None:
    """The draft model of a "draft_model" speculative config; None for other methods."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    path = Path(spec.model)
    if not (path / "config.json").is_file():
        raise ConfigError(f"speculative_config.model: no config.json in {path}")
    draft = ModelConfig.from_path(path)
    check_draft(target, draft, kv_groups, world_size)
    return load_model(path, draft, dtype, device, config.max_model_len, ops)


def check_draft(target: ModelConfig, draft: ModelConfig, kv_groups: KvGroups, world_size: int):
    """The draft must write K/V of the target's shape, read by the same attention kernels."""
    if world_size != 1:
        raise ConfigError("speculative_config: a draft model runs without tensor parallelism")
    if kv_groups.num_groups != 1 or any(draft.layer_windows) or draft.mla or target.mla:
        raise ConfigError(
            "speculative_config: draft models need full-attention target and draft models"
        )
    differ = [name for name in _SAME_SHAPE if getattr(target, name) != getattr(draft, name)]
    if differ:
        raise ConfigError(
            f"speculative_config.model: the draft's {', '.join(differ)} differ from the "
            "target's; it must share the vocabulary and the attention head shapes"
        )


def num_scratch_blocks(config: ExecutorConfig) -> int:
    """Blocks kept out of the scheduler's pool for draft positions past a request's blocks."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return 0
    num_seqs = min(spec.max_num_seqs_to_speculate, config.max_num_seqs)
    return num_seqs * -(-spec.num_speculative_tokens // config.block_size)


class DraftProposer:
    """Proposes with `model`, whose layers read slots `cache` ([draft layers, 2, blocks, ...],
    a view of the shared pool), the scratch blocks being `scratch_ids`; `generator` draws the
    sampled proposals."""

    def __init__(
        self,
        model: Decoder,
        cache: torch.Tensor,
        scratch_ids: list[int],
        block_size: int,
        ops: KernelOps,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model, self.cache, self.generator = model, cache, generator
        self.attention = PagedAttention(ops, model.config.attention_scale)
        self.scratch_ids, self.block_size = scratch_ids, block_size
        # seq id -> (its state, draft K/V kept below this position)
        self._computed: dict[str, tuple[RequestState, int]] = {}

    def propose_for(
        self, batch: InputBatch, num_spec_tokens: dict[str, int]
    ) -> dict[str, list[int]]:
        """The draft's greedy k tokens after each asked sequence's tokens so far."""
        states = [batch.states[s] for s in num_spec_tokens if s in batch.states]
        if not states:
            return {}
        ks = [num_spec_tokens[s.seq_id] for s in states]
        tables = self._tables(batch, states, ks)
        starts = [self._start(s) for s in states]
        chunks = [batch.token_ids[s.row, start : s.num_tokens] for s, start in zip(states, starts)]
        proposals, qs = [[] for _ in states], [[] for _ in states]
        live = list(range(len(states)))
        for j in range(max(ks)):
            if j:  # feed each live sequence's last proposal back
                live = [i for i in live if ks[i] > j]
                chunks = [np.asarray(proposals[i][-1:]) for i in live]
                starts = [states[i].num_tokens - 1 + j for i in live]
            logits = self._run(chunks, starts, tables[live])
            for row, i in enumerate(live):
                token, q = self._pick(logits[row], states[i])
                proposals[i].append(token)
                qs[i].append(q)
        for state, proposal, q in zip(states, proposals, qs):
            # positions below its computed count sit in blocks the scheduler keeps
            self._computed[state.seq_id] = (state, state.num_computed_tokens)
            state.draft_probs = (proposal, torch.stack(q)) if q[0] is not None else None
        return {s.seq_id: p for s, p in zip(states, proposals)}

    def _pick(self, logits: torch.Tensor, state: RequestState) -> tuple[int, torch.Tensor | None]:
        """The greedy token, or for rows under rejection.py's rule a draw from q (the draft's
        softmax at the row's temperature) with q itself."""
        if not samples_drafts(state.params):
            return int(logits.argmax()), None
        q = (logits / state.params.temperature).softmax(dim=-1)
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    def remove(self, batch: InputBatch, state: RequestState) -> None:
        self._computed.pop(state.seq_id, None)

    def _start(self, state: RequestState) -> int:
        """The first position whose draft K/V is missing: 0 for a sequence new to the draft
        (a new request, one re-added after recompute, or after a reset)."""
        known, computed = self._computed.get(state.seq_id, (None, 0))
        return min(computed, state.num_computed_tokens) if known is state else 0

    def _tables(self, batch: InputBatch, states: list[RequestState], ks: list[int]) -> np.ndarray:
        """[num_seqs, blocks]: each request's blocks, then scratch blocks to its last proposal."""
        bs = self.block_size
        per_seq = -(-max(ks) // bs)
        assert len(states) * per_seq <= len(self.scratch_ids), "more proposers than scratch"
        ends = [s.num_tokens - 1 + k for s, k in zip(states, ks)]  # past the last draft write
        tables = np.zeros((len(states), -(-max(ends) // bs)), dtype=np.int32)
        for i, (state, end) in enumerate(zip(states, ends)):
            num = state.num_blocks
            tables[i, :num] = batch.block_table[state.row, :num]
            extra = max(0, -(-end // bs) - num)
            assert extra <= per_seq, f"{state.seq_id}: {extra} scratch blocks"
            tables[i, num : num + extra] = self.scratch_ids[i * per_seq : i * per_seq + extra]
        return tables

    def _run(self, chunks: list[np.ndarray], starts: list[int], tables: np.ndarray) -> torch.Tensor:
        """One draft forward over each sequence's chunk at its start: float32 [num_seqs,
        vocab], the logits after each chunk."""
        device = self.cache.device
        counts = np.fromiter(map(len, chunks), np.int64, len(chunks))
        cu_seqlens = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        seq_of_token = np.repeat(np.arange(len(chunks)), counts)
        block_ids = tables[seq_of_token, positions // self.block_size].astype(np.int64)
        seq_lens = np.asarray(starts, dtype=np.int64) + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        meta = AttentionMetadata(
            slot_mapping=_tensor(block_ids * self.block_size + positions % self.block_size, device),
            block_tables=_tensor(tables[:, :max_blocks], device),
            cu_seqlens_q=_tensor(cu_seqlens.astype(np.int32), device),
            seq_lens=_tensor(seq_lens.astype(np.int32), device),
            max_seqlen_q=int(counts.max()),
        )
        input_ids = _tensor(np.concatenate(chunks).astype(np.int64), device)
        hidden = self.model(input_ids, _tensor(positions, device), self.cache, self.attention, meta)
        last = _tensor(cu_seqlens[1:] - 1, device)
        return self.model.compute_logits(hidden[last])


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
