"""kvpager's offline engine, driven one step at a time so every token gets a timestamp.

`drive()` is `LLM._run` with a clock: schedule, execute, update, then stamp the tokens that came
back and detokenize them as `generate()` does, so it does the same work. After each
`schedule()` it samples KV usage: the token slots the step's K/V fill (each request's computed
plus scheduled tokens, counted once per physical block, so shared prefix blocks count once)
against the slots held by allocated blocks. Sampling time is measured and taken off the clock.
"""

import time
from dataclasses import dataclass, field

from benchmarks.config import BenchConfig
from benchmarks.metrics import EngineResult, SequenceTimes
from benchmarks.workloads import BenchRequest, Workload
from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from engine.scheduler import Scheduler
from schemas.executor import ScheduledStep


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


def warm_up(llm: LLM) -> None:
    """A few short requests so one-time costs (allocator, first kernels) stay off the clock."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[100 + i] * (8 + 8 * i) for i in range(4)], params, use_tqdm=False)
    llm.scheduler.block_manager.reset_prefix_cache()


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
            for block_idx, block_id in enumerate(manager.get_block_table(request.request_id)):
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


def drive(llm: LLM, workload: Workload, engine: str, dtype: str) -> EngineResult:
    """Run the workload to completion through llm's scheduler and executor, stamping tokens."""
    scheduler, executor = llm.scheduler, llm.executor
    stats_before = llm.stats()
    usage = KvUsage()
    requests, detokenizers = [], {}
    for idx, bench in enumerate(workload.requests):
        params = sampling_params(bench)
        request = Request(
            request_id=f"{engine}-{workload.name}-{idx}",
            prompt_token_ids=list(bench.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=llm.model_config.eos_token_ids,
        )
        requests.append(request)
        for k in range(bench.n):
            detokenizers[request.group_id, k] = IncrementalDetokenizer(
                llm.tokenizer, request.prompt_token_ids, params
            )
    index_of = {r.group_id: i for i, r in enumerate(requests)}
    sequences = {i: [SequenceTimes() for _ in range(b.n)] for i, b in enumerate(workload.requests)}
    num_open = [b.n for b in workload.requests]
    finish_times = [0.0] * len(requests)
    num_steps, overhead = 0, 0.0
    start = time.perf_counter()
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished:
        step = scheduler.schedule()
        if not step.num_scheduled_tokens and not scheduler.running:
            raise RuntimeError("scheduler stalled: nothing runs and nothing is admitted")
        tic = time.perf_counter()
        usage.sample(scheduler, step)
        overhead += time.perf_counter() - tic
        output = executor.execute(step)
        updated = scheduler.update_from_output(step, output)
        now = time.perf_counter() - start - overhead
        num_steps += 1
        for request in updated:
            idx, sample = index_of[request.group_id], request.sample_index
            sequences[idx][sample].token_times.append(now)
            detokenizer = detokenizers[request.group_id, sample]
            detokenizer.add_tokens(request.output_token_ids[-1:])
            if request.is_finished:
                detokenizer.flush()
                num_open[idx] -= 1
                if not num_open[idx]:
                    finish_times[idx] = now
    if scheduler.finished_req_ids:  # let the executor drop finished rows, as generate() does
        executor.execute(scheduler.schedule())
    elapsed = time.perf_counter() - start - overhead
    scheduler.block_manager.reset_prefix_cache()  # the next run starts cold
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
        sampling_overhead_s=round(overhead, 3),
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
        finish_times=finish_times,
        latency_source="per token (end of the engine step that sampled it)",
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
