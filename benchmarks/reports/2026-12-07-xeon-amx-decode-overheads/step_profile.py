"""torch's profiler over 20 decode steps of `rows` sequences sampling at temperature 1: the
torch ops of a step by their own CPU time (the C kernels are ctypes calls, not torch ops, so
they do not show; c_time.py times those).

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/step_profile.py \
        bfloat16 64 300
"""

import torch
from decode_setup import decoding_setup
from kvpager.engine import SamplingParams


def main() -> None:
    dtype, rows, llm, prompts = decoding_setup()
    executor, execute = llm.executor, llm.executor._execute
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    decode_steps = 0

    def profiled(step):
        nonlocal decode_steps
        decode_steps += step.total_num_scheduled_tokens == rows
        if decode_steps == 20:
            profile.__enter__()
        out = execute(step)
        if decode_steps == 40:
            profile.__exit__(None, None, None)
            decode_steps += 1
        return out

    executor._execute = profiled
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0)
    llm.generate(prompts, params, use_tqdm=False)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    llm.close()


if __name__ == "__main__":
    main()
