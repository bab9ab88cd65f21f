"""Executor: the model weights, the paged cache tensors, and one step's forward + sampling.

It owns every tensor; the scheduler owns every block id. `execute(step)` applies the step's
deltas to the persistent request table, carries out block copies and swaps, runs one forward
over the flat batch and samples the sequences whose computed tokens caught up.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import torch

from engine.attention import PagedAttention
from engine.config import ModelConfig, parse_dtype
from engine.host_malloc import retain_freed_memory
from engine.input_batch import InputBatch
from engine.model.loader import load_model
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from kernels.backend import default_backend_name, get_kernel_ops
from schemas.errors import ConfigError
from schemas.executor import ScheduledStep
from schemas.scheduler import StepOutput, TokenLogprobs

log = structlog.get_logger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
CPU_SWAP_FRACTION = 4  # default CPU swap pool on a CPU device: a quarter of the KV cache


@dataclass(frozen=True)
class ExecutorConfig:
    model_path: Path
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    gpu_memory_utilization: float = 0.9
    # bytes of host memory for swapped-out and evicted blocks; None: a quarter of the KV
    # cache's size on CPU (swapping there is a memcpy), none on CUDA
    swap_space: int | None = None
    max_num_seqs: int = 256
    max_model_len: int = 4096
    attention_backend: str = "auto"
    seed: int = 0
    # "auto": the model's dtype. "bfloat16" / "float16" halve a float32 model's K/V memory and
    # the bytes decode attention reads; compute stays in the model's dtype (cpu/torch backends)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks: must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory: must be positive")
        if self.swap_space is not None and not 0 <= self.swap_space <= host_memory_bytes():
            raise ConfigError(
                f"swap_space: {self.swap_space} bytes is not in [0, host memory "
                f"{host_memory_bytes()}]"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization: must be in (0, 1]")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when there is a device, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype, except that on a CPU float16 runs in float32, and so
    does bfloat16 without native bf16 matmuls (AVX-512-BF16 / AMX): on an AVX2 machine the
    benchmark measured bf16 at 31.9 output tok/s against 145 for float32."""
    if name != "auto":
        return parse_dtype(name)
    dtype = parse_dtype(model_config.checkpoint_dtype)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return torch.float32
    return dtype


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


class Executor:
    def __init__(self, config: ExecutorConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.backend = config.attention_backend
        if self.backend == "auto":
            self.backend = default_backend_name()
        self.ops = get_kernel_ops(self.backend)
        self.kv_dtype = self._kv_dtype()
        if self.device.type == "cpu":
            retain_freed_memory()
        started = time.perf_counter()
        self.model = load_model(
            config.model_path,
            model_config,
            self.dtype,
            self.device,
            config.max_model_len,
            self.ops,
        )
        self.num_blocks = config.num_blocks or self._blocks_that_fit()
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            (
                model_config.num_layers,
                2,
                self.num_blocks,
                config.block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
            ),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.num_cpu_blocks = self._cpu_blocks_that_fit()
        pin = self.device.type == "cuda"
        cpu_shape = list(self.kv_cache.shape)
        cpu_shape[2] = self.num_cpu_blocks
        # [layers, K/V, cpu_blocks, block_size, kv_heads, head_dim], pinned for async copies
        self.cpu_cache = torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin)
        self.attention = PagedAttention(self.ops, model_config.head_dim**-0.5)
        self.batch = InputBatch(
            config.max_num_seqs, config.max_model_len, config.block_size, self.device
        )
        # unseeded requests draw from one engine-wide generator seeded by `seed`
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        log.info(
            "executor ready",
            device=str(self.device),
            dtype=str(self.dtype),
            kv_cache_dtype=str(self.kv_dtype),
            num_blocks=self.num_blocks,
            backend=self.backend,
            load_s=round(time.perf_counter() - started, 2),
        )

    def _kv_dtype(self) -> torch.dtype:
        if self.config.kv_cache_dtype == "auto":
            return self.dtype
        try:
            kv_dtype = parse_dtype(self.config.kv_cache_dtype)
        except ConfigError as exc:
            raise ConfigError(f"kv_cache_{exc}") from None  # "kv_cache_dtype: unknown ..."
        if kv_dtype != self.dtype and self.backend == "triton":
            raise ConfigError(
                "kv_cache_dtype: a cache dtype other than the model's runs on the cpu and torch "
                "attention backends only"
            )
        return kv_dtype

    def _blocks_that_fit(self) -> int:
        per_block = self.model_config.kv_bytes_per_token(self.kv_dtype) * self.config.block_size
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - self.config.gpu_memory_utilization) * total)
        if budget is None:  # CPU default: never more than every sequence at full length needs
            max_useful = self.config.max_num_seqs * -(
                -self.config.max_model_len // self.config.block_size
            )
            return max(1, min(DEFAULT_CPU_KV_CACHE_BYTES // per_block, max_useful))
        if budget < per_block:
            raise ConfigError(f"kv_cache_memory: {budget} bytes hold no {per_block}-byte block")
        return budget // per_block

    def _cpu_blocks_that_fit(self) -> int:
        per_block = self.model_config.kv_bytes_per_token(self.kv_dtype) * self.config.block_size
        if self.config.swap_space is None:
            return self.num_blocks // CPU_SWAP_FRACTION if self.device.type == "cpu" else 0
        return self.config.swap_space // per_block

    def reset(self) -> None:
        """Forget every request (a new scheduler took over); weights and caches stay as they are.

        The new scheduler starts with every block free, so stale cache contents are never read.
        """
        config = self.config
        self.batch = InputBatch(
            config.max_num_seqs, config.max_model_len, config.block_size, self.device
        )

    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> StepOutput:
        self._apply_deltas(step)
        self._move_blocks(step)
        if not step.num_scheduled_tokens:
            return StepOutput(step_id=step.step_id)
        inputs = self.batch.prepare(step.num_scheduled_tokens)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache, self.attention, inputs.meta
        )
        states, logits_indices = self._with_forks(step, inputs)
        if not states:
            return StepOutput(step_id=step.step_id)
        logits = self.model.compute_logits(hidden[logits_indices])
        beam_rows = [i for i, s in enumerate(states) if s.params.is_beam_search]
        beam_candidates = _beam_candidates(
            logits, states, beam_rows, self.model_config.eos_token_ids
        )
        if beam_rows:
            keep = [i for i, s in enumerate(states) if not s.params.is_beam_search]
            states, logits = [states[i] for i in keep], logits[keep]
        output = self._step_output(step.step_id, states, logits)
        output.beam_candidates = beam_candidates
        return output

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
        if not step.forks:
            return states, indices
        row_of = {state.req_id: i for i, state in enumerate(states)}
        extra = []
        for fork in step.forks:
            parent = self.batch.states[fork.parent_id]
            params = msgspec.structs.replace(parent.params, seed=fork.seed)
            states.append(
                self.batch.fork(fork.parent_id, fork.child_id, params, self._generator(fork.seed))
            )
            extra.append(row_of[fork.parent_id])
        return states, torch.cat([indices, indices[torch.tensor(extra, device=self.device)]])

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(self.device).manual_seed(seed)

    def _apply_deltas(self, step: ScheduledStep) -> None:
        for parent_id, child_id in step.beam_forks:  # before removals: parents may go too
            parent = self.batch.states[parent_id]
            self.batch.fork(parent_id, child_id, parent.params, None)
        for req_id in step.finished_req_ids:
            self.batch.remove(req_id)
        for new in step.new_requests:
            self.batch.add(new, self._generator(new.sampling_params.seed))
        for cached in step.cached_requests:
            self.batch.update(cached)
            for token_id in cached.new_token_ids:
                self.batch.append_token(self.batch.states[cached.req_id], token_id)

    def _sampling_batch(self, states) -> SamplingBatch:
        return SamplingBatch.build(
            params=[s.params for s in states],
            generators=[s.generator for s in states],
            prompt_token_ids=[self.batch.prompt_token_ids(s) for s in states]
            if any(s.params.repetition_penalty != 1.0 for s in states)
            else [[] for _ in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=list(self.model_config.eos_token_ids),
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )

    def _step_output(self, step_id: int, states, logits: torch.Tensor) -> StepOutput:
        if not states:
            return StepOutput(step_id=step_id)
        sampled = self.sampler(logits, self._sampling_batch(states))
        token_ids = sampled.sampled_token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            self.batch.append_token(state, token_id)
        return StepOutput(
            step_id=step_id,
            req_ids=[s.req_id for s in states],
            sampled_token_ids=token_ids,
            logprobs=_logprobs(sampled, states),
        )


def _beam_candidates(logits: torch.Tensor, states, rows: list[int], eos_ids) -> dict:
    """Each beam's best next tokens: enough for transformers' 2 x beam_width continuations."""
    if not rows:
        return {}
    logprobs = logits[rows].log_softmax(dim=-1)
    # per beam at most the group's continuations: (2 + stop tokens) x width bounds them
    needed = max(
        (2 + len(eos_ids) + len(states[i].params.stop_token_ids)) * states[i].params.beam_width
        for i in rows
    )
    values, token_ids = logprobs.topk(min(needed, logprobs.shape[-1]), dim=-1)
    return {
        states[i].req_id: list(zip(ids, vals))
        for i, ids, vals in zip(rows, token_ids.tolist(), values.tolist())
    }


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


def _logprobs(sampled: SamplerOutput, states) -> list[TokenLogprobs] | None:
    if sampled.logprobs is None:
        return None
    values = sampled.logprobs.tolist()
    top_ids = sampled.top_logprob_ids.tolist() if sampled.top_logprob_ids is not None else None
    top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    out = []
    for i, state in enumerate(states):
        k = state.params.logprobs or 0
        out.append(
            TokenLogprobs(
                logprob=values[i],
                top_token_ids=top_ids[i][:k] if top_ids else [],
                top_logprobs=top_values[i][:k] if top_values else [],
            )
        )
    return out
