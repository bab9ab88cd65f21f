"""Scheduler cost per step with N running requests, no model: `engine.sched.scheduler.Scheduler` fed
hand-made StepOutputs (a random token for every request whose computed tokens caught up).

Each request has a `prompt_len` prompt and enough `max_tokens` never to finish. The prompts are
prefilled first (untimed), then `num_steps` decode steps are timed: `schedule()` and
`update_from_output()` separately, with prefix caching on (block hashing included) as in the
engine's default. Every step crosses a block boundary for 1/block_size of the requests.
"""

import random
import statistics
import time

from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.request import Request
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput


def step_output(scheduler: Scheduler, step, rng: random.Random) -> StepOutput:
    seq_ids = [  # a placeholder marks the requests that sample in the step
        seq_id
        for seq_id in step.num_scheduled_tokens
        if scheduler.seqs[seq_id].num_output_placeholders
    ]
    sampled = [rng.randrange(100, 49_000) for _ in seq_ids]
    return StepOutput(step_id=step.step_id, seq_ids=seq_ids, sampled_token_ids=sampled)


def measure(num_running: int, num_steps: int, prompt_len: int = 128, block_size: int = 16):
    rng = random.Random(num_running)
    # a budget that prefills every prompt in the first step; decode steps then schedule one
    # token for each request whatever the budget
    budget = num_running * prompt_len
    max_tokens = num_steps + 8
    max_len = prompt_len + max_tokens
    num_blocks = num_running * (-(-max_len // block_size) + 1)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running, max_num_batched_tokens=budget, max_model_len=max_len
        ),
        CacheConfig(block_size, num_blocks, enable_prefix_caching=True),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for idx in range(num_running):
        prompt = [rng.randrange(100, 49_000) for _ in range(prompt_len)]
        scheduler.add_request(Request(str(idx), prompt, params))
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        step = scheduler.schedule()  # prefill, untimed
        scheduler.update_from_output(step, step_output(scheduler, step, rng))
    schedule_s, update_s = [], []
    for _ in range(num_steps):
        tic = time.perf_counter()
        step = scheduler.schedule()
        mid = time.perf_counter()
        output = step_output(scheduler, step, rng)
        toc = time.perf_counter()
        scheduler.update_from_output(step, output)
        schedule_s.append(mid - tic)
        update_s.append(time.perf_counter() - toc)
        assert len(step.num_scheduled_tokens) == num_running, "not every request decoded"
    scheduler.check_invariants()
    schedule_ms = statistics.median(schedule_s) * 1e3
    update_ms = statistics.median(update_s) * 1e3
    return {
        "num_running": num_running,
        "num_steps": num_steps,
        "schedule_ms_p50": round(schedule_ms, 3),
        "update_ms_p50": round(update_ms, 3),
        "step_ms_p50": round(schedule_ms + update_ms, 3),
        "us_per_request": round((schedule_ms + update_ms) * 1e3 / num_running, 2),
    }


def run_scheduler_cost(sizes=(64, 256, 1024), num_steps: int = 50) -> list[dict]:
    rows = []
    for num_running in sizes:
        row = measure(num_running, num_steps)
        print(
            f"[scheduler] {num_running:5d} running: schedule {row['schedule_ms_p50']:.2f} ms + "
            f"update {row['update_ms_p50']:.2f} ms per step ({row['us_per_request']:.1f} us "
            "per request)",
            flush=True,
        )
        rows.append(row)
    return rows
