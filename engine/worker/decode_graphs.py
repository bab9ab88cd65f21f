"""Decode steps on CPU replayed from their kernel calls (kernels/cpu_graph.py): one graph per
batch size, captured the first time a decode step of that size runs, as vLLM replays a CUDA
graph per batch size. `enforce_eager` turns them off.

A graph's inputs are tensors of its own, refilled each step: the first layer's input and the
rotary rows (Decoder.embed, computed as before), and the attention metadata, with block tables
as wide as the longest context (the kernels read as far as each row's length). What runs
between the kernels in an eager step (the wrappers' checks, output allocations, argument
building) ran once, at capture.

A step whose every sequence brings a few tokens (MAX_ROW_TOKENS: a speculative verify step,
a short prompt) replays as a decode step of a row per token, each row with its sequence's
block table and the context its token sees (causal), as the token-major kernels run short
chunks eagerly (kernels/cpu_decode.py `token_rows`). Verify steps so share the decode steps'
graphs. (Eagerly, fp32 chunks of PREFILL_MIN_CHUNK_F32 tokens or more run on the prefill
kernel, and a tile-layout cache's chunks on the tile kernel whole: the same attention,
summed in another order.)

Only such steps of a model on one CPU process with no recurrent layers are replayed. Where a
model's layers do something a replay would not repeat (kernels/cpu_graph.py says what), graphs
turn off for it, logged once, and every step runs as before. A batch larger than the C
small-row linears take may be refused where a smaller one is not (past AVX512_KERNEL_ROWS on a
host without AMX, its linears run oneDNN's matmul, outside the kernels): graphs then stay for
the smaller batches.
"""

from collections import OrderedDict

import structlog
import torch
from kvpager.engine.model.attention import AttentionMetadata, PagedAttention
from kvpager.engine.model.decoder import Decoder, RopeRows
from kvpager.engine.model.linear_choice import KERNEL_ROWS
from kvpager.kernels import cpu_graph
from kvpager.kernels.cpu_decode import token_rows

log = structlog.get_logger(__name__)

# graphs kept (least recently used go first): a 64-row bf16 SmolLM2 graph holds ~1 MB
MAX_GRAPHS = 64
# most tokens of one sequence in a step replayed as rows: a verify step's proposals and the
# token before them (suffix decoding proposes up to 24 by default, vLLM's depth); longer
# chunks read their context once a chunk on the prefill kernels, where rows read it once a
# token, and rarely repeat a batch's size (each new size costs a capture)
MAX_ROW_TOKENS = 32


def as_token_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """meta as a decode step's: a row per query token, with its sequence's block table and
    the context it sees (its own position and those before it)."""
    cu_seqlens_q = meta.cu_seqlens_q
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of_token, context = token_rows(cu_seqlens_q, meta.seq_lens, q_lens)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.index_select(0, seq_of_token),
        cu_seqlens_q=torch.arange(len(context) + 1, dtype=torch.int32),
        seq_lens=context,
        max_seqlen_q=1,
    )


def _replayable(meta: AttentionMetadata, rows: int) -> bool:
    """A decode step, or one whose every sequence brings at most MAX_ROW_TOKENS tokens."""
    if meta.max_seqlen_q == 1:
        return len(meta.seq_lens) == rows
    return meta.max_seqlen_q <= MAX_ROW_TOKENS


class _StaticInputs:
    """The tensors one graph reads: refilled in place from each step's own."""

    def __init__(self, x: torch.Tensor, rope: RopeRows, metas: tuple, max_blocks: int) -> None:
        self.x = torch.empty_like(x)
        self.rope = _map_rope(rope, torch.empty_like)
        rows = len(metas[0].seq_lens)
        seq_lens = torch.empty(rows, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32)  # one token each
        self.metas = tuple(
            AttentionMetadata(
                slot_mapping=torch.empty(rows, dtype=torch.int64),
                block_tables=torch.zeros(rows, max_blocks, dtype=torch.int32),
                cu_seqlens_q=self.cu_seqlens_q,
                seq_lens=seq_lens,
                max_seqlen_q=1,
            )
            for _ in metas
        )

    def tensors(self) -> list[torch.Tensor]:
        meta_tensors = [(m.slot_mapping, m.block_tables) for m in self.metas]
        rope = [t for part in self.rope if part is not None for t in _parts(part)]
        return [self.x, *rope, self.metas[0].seq_lens, *(t for pair in meta_tensors for t in pair)]

    def fill(self, x: torch.Tensor, rope: RopeRows, metas: tuple) -> None:
        self.x.copy_(x)
        for static, step in zip(self.rope, rope):
            for dst, src in zip(_parts(static), _parts(step)):
                dst.copy_(src)
        self.metas[0].seq_lens.copy_(metas[0].seq_lens)
        for static, step in zip(self.metas, metas):
            static.slot_mapping.copy_(step.slot_mapping)
            static.block_tables[:, : step.block_tables.shape[1]].copy_(step.block_tables)


def _parts(part) -> tuple:
    return part if isinstance(part, tuple) else () if part is None else (part,)


def _map_rope(rope: RopeRows, fn) -> RopeRows:
    """fn over every tensor of rope, its pairs and Nones kept."""

    def mapped(part):
        if part is None:
            return None
        return tuple(map(fn, part)) if isinstance(part, tuple) else fn(part)

    return RopeRows(*map(mapped, rope))


class DecodeGraphs:
    """The executor's decode graphs: `forward` returns a decode step's hidden states from a
    replay, or None where the step runs eagerly."""

    def __init__(self, model: Decoder, attention: PagedAttention, max_blocks: int) -> None:
        self.model, self.attention, self.max_blocks = model, attention, max_blocks
        self.graphs: OrderedDict[int, tuple] = OrderedDict()  # rows -> (inputs, graph)
        self.cache_ptr = 0  # the KV cache the graphs point into
        self.off = model.group is not None  # a collective is no kernel call
        self.max_rows: int | None = None  # larger batches run eagerly (None: no bound)
        # kernels of graphs a replay has checked: a capture calling others is checked too
        self.checked: frozenset[str] = frozenset()

    def forward(self, input_ids, positions, kv_cache, meta, recurrent) -> torch.Tensor | None:
        metas = meta if isinstance(meta, tuple) else (meta,)
        rows = len(input_ids)
        if self.off or recurrent is not None or input_ids.device.type != "cpu":
            return None
        if not _replayable(metas[0], rows):
            return None
        if self.max_rows is not None and rows > self.max_rows:
            return None
        if kv_cache.data_ptr() != self.cache_ptr:  # a new cache: the old graphs point away
            self.graphs.clear()
            self.cache_ptr = kv_cache.data_ptr()
        # the step's own metadata here: longrope picks its rows by the sequences' lengths
        x, rope = self.model.embed(input_ids, positions, meta)
        if metas[0].max_seqlen_q > 1:
            metas = tuple(map(as_token_rows, metas))
        entry = self.graphs.get(rows)
        if entry is None:
            return self._capture(x, rope, metas, kv_cache, isinstance(meta, tuple))
        self.graphs.move_to_end(rows)
        inputs, graph = entry
        inputs.fill(x, rope, metas)
        try:
            return graph.replay().clone()
        except cpu_graph.ReplayError as error:  # this step runs eagerly, the next captures anew
            log.warning("decode graph replay failed", rows=rows, error=str(error))
            del self.graphs[rows]
            return None

    def _refused(self, rows: int, reason: str) -> None:
        """A capture at `rows` computed outside the kernels. Past the C small-row linears'
        rows, larger batches run eagerly from now on and smaller ones replay (up to the largest
        captured so far, else KERNEL_ROWS, which every host's kernels take); a second refusal,
        or one at KERNEL_ROWS or fewer, turns graphs off."""
        if rows > KERNEL_ROWS and self.max_rows is None:
            self.max_rows = max((n for n in self.graphs if n < rows), default=KERNEL_ROWS)
            log.info("decode graphs for small batches only", max_rows=self.max_rows, reason=reason)
            return
        self.off = True
        log.info("decode graphs off for this model", reason=reason)

    def _needs_check(self, kernels: frozenset[str]) -> bool:
        return not kernels <= self.checked

    def _capture(self, x, rope, metas, kv_cache, grouped: bool) -> torch.Tensor | None:
        inputs = _StaticInputs(x, rope, metas, self.max_blocks)
        inputs.fill(x, rope, metas)
        meta = inputs.metas if grouped else inputs.metas[0]

        def region() -> torch.Tensor:
            return self.model.run_layers(inputs.x, inputs.rope, kv_cache, self.attention, meta)

        try:
            graph = cpu_graph.capture(
                region, inputs.tensors(), [inputs.cu_seqlens_q], self._needs_check
            )
        except cpu_graph.CaptureError as error:
            self._refused(len(x), str(error))
            return None
        except Exception:  # a capture's own fault must not fail the step: it runs eagerly
            self.off = True
            log.exception("decode graph capture failed; graphs off for this model")
            return None
        self.checked |= graph.kernels
        self.graphs[len(x)] = (inputs, graph)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        log.debug("decode graph captured", rows=len(x), calls=len(graph.calls),
                  buffer_bytes=graph.num_bytes)  # fmt: skip
        return graph.output.clone()
