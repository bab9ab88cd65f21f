"""Executor: the model weights, the paged cache tensors, and one step's forward + sampling.

It owns every tensor; the scheduler owns every block id. `execute(step)` applies the step's
deltas to the persistent request table, carries out block copies and swaps, runs one forward
over the flat batch and samples the sequences whose computed tokens caught up.
"""

import time

import msgspec
import structlog
import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.memory import resolve_device, resolve_dtype
from kvpager.engine.model.attention import PagedAttention
from kvpager.engine.model.loader import load_model
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.group import TensorParallel
from kvpager.engine.parallel.ranks import Ranks
from kvpager.engine.worker.beam_candidates import top_continuations
from kvpager.engine.worker.decode_graphs import DecodeGraphs
from kvpager.engine.worker.disk.store import open_disk
from kvpager.engine.worker.grammar_rows import GrammarRows
from kvpager.engine.worker.host_malloc import retain_freed_memory
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.kv_cache import allocate_kv_caches, kv_cache_dtype
from kvpager.engine.worker.prompt_logprobs import compute_prompt_logprobs
from kvpager.engine.worker.sampling.sampler import Sampler
from kvpager.engine.worker.sampling.step_sampling import StepSampler
from kvpager.engine.worker.spec_decode.draft_model import (
    DraftProposer,
    load_draft,
    num_scratch_blocks,
)
from kvpager.engine.worker.spec_decode.proposer import make_proposer
from kvpager.engine.worker.state_cache import make_state_cache, state_slot_bytes
from kvpager.engine.worker.step_check import Capacity, StepCheck
from kvpager.kernels.backend import (
    check_backend_device,
    default_backend_name,
    get_kernel_ops,
    with_cache_layout,
)
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import RankReset, RankStep, ScheduledStep
from kvpager.schemas.scheduler import ExecutorReady, StepOutput

log = structlog.get_logger(__name__)


class Executor:
    """One rank's executor. Alone, `group` and `ranks` are None. In a tensor-parallel group
    every rank builds one with its `group` (its shard of the weights and cache, the same block
    count); rank 0 also holds `ranks`, through which each step reaches the others first."""

    def __init__(
        self,
        config: ExecutorConfig,
        model_config: ModelConfig,
        group: TensorParallel | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.group, self.ranks = group, ranks
        rank, size = (group.rank, group.world_size) if group else (0, 1)
        self.shard = Shard.of(model_config, rank, size)
        self.kv_groups = kv_groups(
            model_config.layer_windows, model_config.num_layers, model_config.cacheless_layers
        )
        self._pick_device_and_kernels()
        started = time.perf_counter()
        self.model = load_model(
            config.model_path, model_config, self.dtype, self.device, config.max_model_len,
            self.ops, self.shard, group,
        )  # fmt: skip
        self.draft = load_draft(
            config, model_config, self.kv_groups, self.dtype, self.device, self.ops, size
        )
        self._allocate_caches(size)
        # recurrent layers' states (engine/worker/state_cache.py), carved out of the caches'
        # budgets (engine/kv/state_pool.py); None for other models
        self.state_cache = make_state_cache(
            model_config, self.dtype, self.device, self.pool, self.host_pool, size
        )
        self.disk = open_disk(
            config, self.cpu_cache, self.kv_dtype, rank, size, self.kv_groups.windows,
            self.ops.kv_layout,
        )  # fmt: skip
        self.attention = PagedAttention(self.ops, model_config.attention_scale)
        self.graphs = self._decode_graphs()
        self.batch = self._new_batch()
        # unseeded requests draw from one engine-wide generator seeded by `seed`
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.step_check = StepCheck(self.capacity)
        self.grammars = GrammarRows(
            config.tokenizer or config.model_path,
            model_config.vocab_size,
            model_config.eos_token_ids,
            config.grammar_compile_timeout,
        )
        self.step_sampler = StepSampler(self.sampler, self.grammars, model_config, self.device)
        self.proposer = make_proposer(config.speculative_config, self._draft_proposer())
        self._log_ready(rank, size, time.perf_counter() - started)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Replayed decode steps, on the cpu backend alone (engine/worker/decode_graphs.py)."""
        config = self.config
        if config.enforce_eager or self.device.type != "cpu" or self.backend != "cpu":
            return None
        max_blocks = -(-config.max_model_len // config.block_size)  # the longest context's
        return DecodeGraphs(self.model, self.attention, max_blocks)

    def _new_batch(self) -> InputBatch:
        config = self.config
        return InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            config.block_size,
            self.device,
            self.kv_groups.num_groups,
        )

    def _pick_device_and_kernels(self) -> None:
        config = self.config
        self.device = rank_device(config.device, self.group)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.backend = config.attention_backend
        if self.backend == "auto":
            self.backend = default_backend_name(self.device)
        check_backend_device(self.backend, self.device)
        self.kv_dtype = kv_cache_dtype(config, self.dtype, self.backend)
        shard, model_config = self.shard, self.model_config
        head_dim = model_config.cache_head_dim  # MLA: half its latent row
        cache_shape = (shard.num_heads, shard.num_kv_heads, head_dim, config.block_size)
        self.ops = with_cache_layout(
            get_kernel_ops(self.backend), self.dtype, self.kv_dtype, cache_shape,
            model_config.attn_logit_softcapping or 0.0, config.kv_layout,
        )  # fmt: skip
        if self.device.type == "cpu":
            retain_freed_memory()

    def _log_ready(self, rank: int, size: int, load_s: float) -> None:
        log.info(
            "executor ready",
            device=str(self.device),
            dtype=str(self.dtype),
            kv_cache_dtype=str(self.kv_dtype),
            num_blocks=self.num_blocks,
            backend=self.backend,
            rank=rank,
            world_size=size,
            kv_layout=self.ops.kv_layout,
            num_threads=torch.get_num_threads(),  # on CPU: OMP_NUM_THREADS, or every core
            load_s=round(load_s, 2),
            **(self.pool.fields("pool_") if self.pool.slot_bytes else {}),
            **(self.host_pool.fields("host_pool_") if self.host_pool.slot_bytes else {}),
        )

    def _allocate_caches(self, world_size: int) -> None:
        """The device KV cache, sized to what fits beside the recurrent states, and the CPU
        pool for swapped blocks; with a draft model, its layers' slots follow the target's and
        the last blocks are its scratch, kept out of the scheduler's pool
        (spec_decode/draft_model.py)."""
        draft_slots = 0 if self.draft is None else len(self.draft.layers)
        slot_bytes = state_slot_bytes(self.config, self.model_config, self.dtype, world_size)
        self.kv_cache, self.cpu_cache, self.pool, self.host_pool = allocate_kv_caches(
            self.config, self.model_config, self.shard, self.kv_groups, self.kv_dtype,
            self.device, self.group, draft_slots, slot_bytes,
        )  # fmt: skip
        self.num_blocks = self.kv_cache.shape[2] - num_scratch_blocks(self.config)
        self.num_cpu_blocks = self.cpu_cache.shape[2]
        if self.num_blocks < 1:
            raise ConfigError("speculative_config: no KV blocks are left beside the scratch")

    def _draft_proposer(self) -> DraftProposer | None:
        if self.draft is None:
            return None
        cache = self.kv_cache[self.kv_groups.num_slots :]  # the draft's layer slots
        scratch = list(range(self.num_blocks, self.kv_cache.shape[2]))
        return DraftProposer(
            self.draft, cache, scratch, self.config.block_size, self.ops, self.sampler.generator
        )

    @property
    def capacity(self) -> Capacity:
        config = self.config
        return Capacity(
            num_blocks=self.num_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            vocab_size=self.model_config.vocab_size,
            group_windows=self.kv_groups.windows,
            num_state_slots=self.num_state_slots,
            num_snapshot_slots=self.num_snapshot_slots,
            num_host_state_slots=self.host_state_rows[0],
            num_host_snapshot_slots=self.host_state_rows[1],
        )

    @property
    def num_state_slots(self) -> int:
        return self.state_cache.num_slots if self.state_cache is not None else 0

    @property
    def num_snapshot_slots(self) -> int:
        return self.state_cache.num_snapshot_slots if self.state_cache is not None else 0

    @property
    def host_state_rows(self) -> tuple[int, int]:
        """Host rows of the state: for swapped sequences, for lower tiers' snapshots."""
        cache = self.state_cache
        return (cache.num_host_slots, cache.num_host_snapshot_slots) if cache else (0, 0)

    def ready(self, executor_id: str, model: str) -> ExecutorReady:
        """What this executor holds, for the scheduler to be built with."""
        config = self.config
        return ExecutorReady(
            executor_id=executor_id,
            num_blocks=self.num_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            eos_token_ids=list(self.model_config.eos_token_ids),
            vocab_size=self.model_config.vocab_size,
            model=model,
            kv_on_host=self.device.type == "cpu",
            world_size=self.shard.world_size,
            kv_disk=self.disk is not None,
            kv_group_windows=list(self.kv_groups.windows),
            num_state_slots=self.num_state_slots,
            num_snapshot_slots=self.num_snapshot_slots,
            state_slot_bytes=self.state_cache.slot_bytes if self.state_cache is not None else 0,
            num_host_state_slots=self.host_state_rows[0],
            num_host_snapshot_slots=self.host_state_rows[1],
            kv_block_bytes=self.pool.block_bytes,
            kv_budget_bytes=self.pool.budget_bytes,
        )

    def reset(self) -> None:
        """Forget every request (a new scheduler took over); weights and caches stay as they are.

        The new scheduler starts with every block free, so stale cache contents are never read.
        """
        if self.ranks is not None:
            with self.ranks.running(RankReset()):
                self._reset()
        else:
            self._reset()

    def _reset(self) -> None:
        if self.disk is not None:
            self.disk.reset()
        self.batch = self._new_batch()
        self.grammars.clear()

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run one step; on rank 0 of a group, every other rank runs it too (their outputs,
        identical, are dropped: the logits are gathered, so each rank samples the same).

        A step that does not fit this executor raises InvalidStepError before anything of it
        is applied (and before other ranks see it)."""
        if self.ranks is not None:
            self.ranks.check_alive()  # a lost group says so, whatever the step
        self.step_check.check(step, self.batch)
        if self.ranks is None:
            return self._execute(step)
        with self.ranks.running(RankStep(step)):
            return self._execute(step)

    def close(self) -> None:
        """Rank 0: stop the other ranks; finish the disk tier's queued writes."""
        if self.ranks is not None:
            self.ranks.close()
        if self.disk is not None:
            self.disk.close()

    @torch.inference_mode()
    def _execute(self, step: ScheduledStep) -> StepOutput:
        self._apply_deltas(step)
        if self.disk is not None:  # before the swap-outs reuse the CPU blocks
            self.disk.save(step.blocks_to_disk, self.cpu_cache, self.kv_cache)
        self._move_blocks(step)
        if self.disk is not None:  # into CPU blocks this step leaves alone
            self.disk.load(step.blocks_from_disk, self.cpu_cache)
        if self.state_cache is not None:
            self.state_cache.before_forward(step)
        output = self._forward(step)
        if self.state_cache is not None:
            self.state_cache.after_forward(step)
        output.failed = self.grammars.take_failed()
        if self.disk is not None:
            self.disk.report(output, wait=not step.num_scheduled_tokens)
        return output

    def _forward(self, step: ScheduledStep) -> StepOutput:
        if not step.num_scheduled_tokens:
            return StepOutput(step_id=step.step_id)
        inputs = self.batch.prepare(step.num_scheduled_tokens)
        recurrent = None
        if self.state_cache is not None:
            prompt_counts = self.batch.prompt_counts(step.num_scheduled_tokens)
            recurrent = self.state_cache.batch(step, prompt_counts)
        step_inputs = (inputs.input_ids, inputs.positions, self.kv_cache)
        hidden = None if self.graphs is None else self.graphs.forward(
            *step_inputs, inputs.meta, recurrent
        )  # fmt: skip
        if hidden is None:
            hidden = self.model(*step_inputs, self.attention, inputs.meta, recurrent)
        # under tensor parallelism every rank gathers the logits, rank 0 alone reports
        prompt_logprobs = compute_prompt_logprobs(
            self.model, hidden, inputs.prompt_spans, self.batch.token_ids, self.shard.rank == 0
        )
        states, logits_indices = self._with_forks(step, inputs)
        if not states:
            return StepOutput(step_id=step.step_id, prompt_logprobs=prompt_logprobs)
        logits, draft_logits = self._logits(hidden, logits_indices, inputs.draft_indices)
        beam_rows = [i for i, s in enumerate(states) if s.params.is_beam_search]
        beam_candidates = top_continuations(
            logits, states, beam_rows, self.model_config.eos_token_ids
        )
        if beam_rows:
            keep = [i for i, s in enumerate(states) if not s.params.is_beam_search]
            states, logits = [states[i] for i in keep], logits[keep]
        output = self.step_sampler.sample(step.step_id, self.batch, states, logits, draft_logits)
        output.beam_candidates = beam_candidates
        output.draft_token_ids = self.proposer.propose_for(self.batch, step.num_spec_tokens)
        output.prompt_logprobs = prompt_logprobs
        return output

    def _logits(self, hidden, indices, draft_indices) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled rows' logits and those of the positions verifying proposals (None
        where there are none), from one pass of the lm_head: it reads its weight once a
        call (113 MB in fp32 for SmolLM2), whatever the rows."""
        if draft_indices is None:
            return self.model.compute_logits(hidden[indices]), None
        both = self.model.compute_logits(hidden[torch.cat([indices, draft_indices])])
        return both[: len(indices)], both[len(indices) :]

    def _move_blocks(self, step: ScheduledStep) -> None:
        """Swap-outs first (they save content that swap-ins and copies may overwrite)."""
        if step.blocks_to_swap_out:
            self.ops.swap_blocks(self.kv_cache, self.cpu_cache, _pairs(step.blocks_to_swap_out))
        if step.blocks_to_swap_in:
            self.ops.swap_blocks(self.cpu_cache, self.kv_cache, _pairs(step.blocks_to_swap_in))
        if step.blocks_to_copy:
            self.ops.copy_blocks(self.kv_cache, _pairs(step.blocks_to_copy).to(self.device))

    def _with_forks(self, step: ScheduledStep, inputs) -> tuple[list, torch.Tensor]:
        """Sampled rows plus forked samples, which sample from their parent's logits row."""
        states, indices = list(inputs.sampled_states), inputs.logits_indices
        forks = [fork for fork in step.forks if fork.sample]
        if not forks:
            return states, indices
        row_of = {state.seq_id: i for i, state in enumerate(states)}
        extra = []
        for fork in forks:
            parent = self.batch.states[fork.parent_id]
            params = msgspec.structs.replace(parent.params, seed=fork.seed)
            states.append(self.batch.fork(fork.parent_id, fork.child_id, params))
            self.grammars.fork(fork.parent_id, fork.child_id)  # before the parent advances
            extra.append(row_of[fork.parent_id])
        return states, torch.cat([indices, indices[torch.tensor(extra, device=self.device)]])

    def _apply_deltas(self, step: ScheduledStep) -> None:
        for fork in step.forks:  # before removals: parents may go too
            if not fork.sample:
                parent = self.batch.states[fork.parent_id]
                self.batch.fork(fork.parent_id, fork.child_id, parent.params)
                self.grammars.fork(fork.parent_id, fork.child_id)
        for seq_id in step.finished_seq_ids:
            if seq_id in self.batch.states:  # suffix decoding keeps its output
                self.proposer.remove(self.batch, self.batch.states[seq_id])
            self.batch.remove(seq_id)
            self.grammars.remove(seq_id)
        for new in step.new_requests:
            self.grammars.add(self.batch.add(new))
        for cached in step.cached_requests:
            self.batch.update(cached)
            for token_id in cached.new_token_ids:
                self.batch.append_token(self.batch.states[cached.seq_id], token_id)


def rank_device(name: str, group: TensorParallel | None) -> torch.device:
    """The device, and on CUDA in a group the rank's own (`cuda:<local rank>`)."""
    device = resolve_device(name)
    if group is not None and device.type == "cuda":
        return torch.device("cuda", group.local_rank)
    return device


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
