"""What the executor's step check costs (engine/worker/step_check.py): the check alone, on the
steps of a full SmolLM2-135M batch, against the executor's step time on the same steps.

    python -m benchmarks.engine.step_check [--seqs 64] [--context 230] [--prefill 2048] \
        [--rounds 2000]

Two steps: a decode step of `--seqs` running sequences (one token each, every 16th crossing a
block) and a prefill step of 8 new prompts of `--prefill / 8` tokens beside them. The check walks
the same step the executor would run; its cost is printed in microseconds a step and as a share
of `--step-ms`, the executor's step time for such a batch (default 104 ms: the ITL p50 of
`benchmarks/peers/run.py --engines kvpager --workloads sharegpt-like -n 64`, float32, measured on
the 2-core AVX-512 host of the README's numbers; a decode step yields one token a sequence).
"""

import argparse
import statistics
import time

import numpy as np
import torch
from kvpager.engine.worker.input_batch import InputBatch
from kvpager.engine.worker.step_check import Capacity, StepCheck
from kvpager.kernels.isa import isa_flags
from kvpager.schemas.executor import CachedRequest, NewRequest, ScheduledStep
from kvpager.schemas.sampling import SamplingParams

BLOCK = 16


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=230)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=104.0)
    return parser.parse_args(argv)


def running_batch(capacity: Capacity, seqs: int, context: int) -> InputBatch:
    """`seqs` requests known to the executor, each `context` tokens computed but its last."""
    batch = InputBatch(capacity.max_num_seqs, capacity.max_model_len, BLOCK, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for i in range(seqs):
        num_blocks = -(-(context + 1) // BLOCK)
        blocks = rng.choice(capacity.num_blocks, num_blocks, replace=False).tolist()
        prompt = rng.integers(0, capacity.vocab_size, context).tolist()
        batch.add(NewRequest(f"r{i}", prompt, context, SamplingParams(), blocks, context - 1))
    return batch


def decode_step(seqs: int, context: int) -> ScheduledStep:
    cached = [
        CachedRequest(f"r{i}", context - 1, new_block_ids=[7] if i % 16 == 0 else [])
        for i in range(seqs)
    ]
    return ScheduledStep(
        1, cached_requests=cached, num_scheduled_tokens={c.seq_id: 1 for c in cached}
    )


def prefill_step(seqs: int, context: int, prefill: int) -> ScheduledStep:
    step = decode_step(seqs - 8, context)
    length = prefill // 8
    for i in range(8):
        blocks = list(range(100 + i * 40, 100 + i * 40 + -(-length // BLOCK)))
        new = NewRequest(f"p{i}", [5] * length, length, SamplingParams(), blocks, 0)
        step.new_requests.append(new)
        step.num_scheduled_tokens[new.seq_id] = length
    return step


def time_check(check: StepCheck, step: ScheduledStep, batch: InputBatch, rounds: int) -> float:
    """Median microseconds of one check."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        check.check(step, batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    capacity = Capacity(
        num_blocks=20000,
        num_cpu_blocks=4000,
        block_size=BLOCK,
        max_num_seqs=256,
        max_model_len=8192,
        vocab_size=49152,
    )
    check = StepCheck(capacity)
    batch = running_batch(capacity, args.seqs, args.context)
    steps = {
        f"decode, {args.seqs} sequences": decode_step(args.seqs, args.context),
        f"prefill {args.prefill} tokens + {args.seqs - 8} decoding": prefill_step(
            args.seqs, args.context, args.prefill
        ),
    }
    print(f"isa: {' '.join(isa_flags())}")
    for name, step in steps.items():
        micros = time_check(check, step, batch, args.rounds)
        share = micros / (args.step_ms * 1e3)
        print(f"{name}: {micros:.1f} us a step, {share:.2%} of a {args.step_ms:g} ms step")


if __name__ == "__main__":
    main()
