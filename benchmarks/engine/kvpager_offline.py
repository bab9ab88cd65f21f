"""kvpager's offline engine, driven one step at a time so every token gets a timestamp.

`drive()` runs the LLM's own engine core (same step pipeline and plan-ahead depth as
`generate()`) with a publish hook that stamps the tokens as they come out and detokenizes them
as `generate()` does, so it does the same work. As each step is submitted it samples KV usage:
the token slots the step's K/V fill (each request's computed plus scheduled tokens, counted
once per physical block, so shared prefix blocks count once) against the slots held by
allocated blocks. Sampling time is measured and taken off the clock.
"""

import time
from dataclasses import dataclass, field

from kvpager.engine import LLM, SamplingParams
from kvpager.engine.core import EngineCore
from kvpager.engine.frontend.output_processor import SampleOutput
from kvpager.engine.request import Request
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.bench.metrics import EngineResult, SequenceTimes
from kvpager.services.bench.workloads import BenchRequest, Workload

from benchmarks.common.config import BenchConfig


def build_llm(cfg: BenchConfig, **overrides) -> LLM:
    kwargs = dict(
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        kv_cache_memory=cfg.kv_cache_bytes,
        kv_cache_dtype=cfg.kv_cache_dtype,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
    )
    kwargs.update(overrides)
    return LLM(str(cfg.model_path), **kwargs)


def sampling_params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(
        n=request.n,
        temperature=request.temperature,
        max_tokens=request.max_tokens,
        ignore_eos=True,
        seed=request.seed,
    )


@dataclass
class KvUsage:
    """Per-step KV block usage; `util` = token slots filled / slots in allocated blocks."""

    peak_used_blocks: int = 0
    util_at_peak: float = 0.0
    running_at_peak: int = 0
    peak_running: int = 0
    running_per_step: list[int] = field(default_factory=list)
    stored_slots: int = 0  # summed over steps, for the allocation-weighted mean
    allocated_slots: int = 0

    def sample(self, scheduler: Scheduler, step: ScheduledStep) -> None:
        manager = scheduler.block_manager
        used, block_size = manager.num_used_blocks, manager.block_size
        self.running_per_step.append(len(scheduler.running))
        self.peak_running = max(self.peak_running, len(scheduler.running))
        if not used:
            return
        filled: dict[int, int] = {}  # block id -> slots holding K/V after this step
        for request in scheduler.running:
            num_tokens = request.num_computed_tokens  # schedule() counted this step's already
            for block_idx, block_id in enumerate(manager.get_block_table(request.seq_id)):
                num_slots = min(block_size, num_tokens - block_idx * block_size)
                if num_slots <= 0:
                    break
                filled[block_id] = max(filled.get(block_id, 0), num_slots)
        stored = sum(filled.values())
        self.stored_slots += stored
        self.allocated_slots += used * block_size
        util = stored / (used * block_size)
        # at a tie keep the worst step, so the reported figure is the conservative one
        if used > self.peak_used_blocks or (
            used == self.peak_used_blocks and util < self.util_at_peak
        ):
            self.peak_used_blocks, self.util_at_peak = used, util
            self.running_at_peak = len(scheduler.running)

    def summary(self) -> dict:
        steps = self.running_per_step or [0]
        return {
            "peak_used_blocks": self.peak_used_blocks,
            "kv_util_at_peak": round(self.util_at_peak, 4),
            "kv_util_mean": round(self.stored_slots / max(1, self.allocated_slots), 4),
            "peak_running": self.peak_running,
            "running_at_peak": self.running_at_peak,
            "mean_running": round(sum(steps) / len(steps), 1),
        }


class _SampledRunner:
    """The LLM's in-process executor, with KV usage sampled as each step is submitted."""

    def __init__(self, llm: LLM, usage: KvUsage) -> None:
        self.runner, self.scheduler, self.usage = llm.runner, llm.scheduler, usage
        self.overhead = 0.0

    async def submit(self, step: ScheduledStep) -> None:
        tic = time.perf_counter()
        self.usage.sample(self.scheduler, step)
        self.overhead += time.perf_counter() - tic
        await self.runner.submit(step)

    async def result(self, step_id: int):
        return await self.runner.result(step_id)

    def cancel(self) -> None:
        self.runner.cancel()


class _Stamps:
    """Token times per sample, and each request's finish time, from the core's deltas."""

    def __init__(self, llm: LLM, workload: Workload, requests: list[Request]) -> None:
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        self.sequences = {
            i: [SequenceTimes() for _ in range(b.n)] for i, b in enumerate(workload.requests)
        }
        self.samples = {
            (r.request_id, k): SampleOutput(llm.tokenizer, r.prompt_token_ids, r.sampling_params)
            for r in requests
            for k in range(r.sampling_params.n)
        }
        self.num_open = [b.n for b in workload.requests]
        self.finish_times = [0.0] * len(requests)

    def add(self, deltas: list[SampleDelta], now: float) -> None:
        for delta in deltas:
            idx, sample = self.index_of[delta.request_id], delta.index
            self.sequences[idx][sample].token_times += [now] * len(delta.token_ids)
            self.samples[delta.request_id, sample].add(delta)  # detokenized, as generate()
            if delta.finish_reason is not None:
                self.num_open[idx] -= 1
                if not self.num_open[idx]:
                    self.finish_times[idx] = now


def _requests(llm: LLM, workload: Workload, engine: str) -> list[Request]:
    return [
        Request(
            seq_id=f"{engine}-{workload.name}-{idx}",
            prompt_token_ids=list(bench.prompt_token_ids),
            sampling_params=sampling_params(bench),
            eos_token_ids=llm.model_config.eos_token_ids,
        )
        for idx, bench in enumerate(workload.requests)
    ]


def drive(llm: LLM, workload: Workload, engine: str, dtype: str) -> EngineResult:
    """Run the workload to completion through llm's engine core, stamping tokens."""
    stats_before = llm.stats()
    usage = KvUsage()
    requests = _requests(llm, workload, engine)
    stamps = _Stamps(llm, workload, requests)
    runner = _SampledRunner(llm, usage)
    start = time.perf_counter()

    async def publish(deltas: list[SampleDelta], step_id: int) -> None:
        stamps.add(deltas, time.perf_counter() - start - runner.overhead)

    core = EngineCore(llm.scheduler, runner, publish, llm.config.plan_ahead)
    for request in requests:
        core.add(request)

    async def run() -> int:
        num_steps = 0
        while core.has_work:
            num_steps += await core.run_step()
        await core.publish()
        return num_steps

    num_steps = llm.run_async(run())
    elapsed = time.perf_counter() - start - runner.overhead
    llm.scheduler.block_manager.reset_prefix_cache()  # the next run starts cold
    sequences = stamps.sequences
    produced = sum(len(s.token_times) for seqs in sequences.values() for s in seqs)
    assert produced == workload.num_output_tokens, f"{produced} != {workload.num_output_tokens}"
    stats = llm.stats()
    extra = usage.summary()
    extra.update(
        num_blocks=stats["num_blocks"],
        num_steps=num_steps,
        num_preemptions=stats["num_preemptions"] - stats_before["num_preemptions"],
        num_swap_preemptions=stats["num_swap_preemptions"] - stats_before["num_swap_preemptions"],
        prefix_hit_tokens=stats["prefix_cache_hit_tokens"]
        - stats_before["prefix_cache_hit_tokens"],
        sampling_overhead_s=round(runner.overhead, 3),
    )
    return EngineResult(
        engine,
        workload.name,
        dtype,
        elapsed_s=elapsed,
        num_requests=len(requests),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=workload.num_output_tokens,
        sequences=sequences,
        finish_times=stamps.finish_times,
        latency_source="per token (when the engine core published it)",
        extra=extra,
    )


def run_generate(llm: LLM, workload: Workload, dtype: str) -> EngineResult:
    """Plain `LLM.generate()` on the same workload: throughput only, to check drive()'s clock."""
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    params = [sampling_params(r) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert produced == workload.num_output_tokens, f"{produced} != {workload.num_output_tokens}"
    llm.scheduler.block_manager.reset_prefix_cache()
    return EngineResult(
        "kvpager LLM.generate",
        workload.name,
        dtype,
        elapsed_s=elapsed,
        num_requests=len(prompts),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=workload.num_output_tokens,
        latency_source="none (whole-batch call)",
    )
