"""Tensor parallelism: what N ranks cost or gain against one, in one run.

    python -m benchmarks.engine.tensor_parallel cpu [--repeats 2] [--out tp-cpu.json]
    python -m benchmarks.engine.tensor_parallel gpu --model PATH [--sizes 1 2 4 8] \
        [--out tp-gpu.json]

cpu: TP=2 with one thread a rank against TP=1 with two threads, rounds interleaved, the same
  greedy workload (ignore_eos), tokens checked equal. The model is a random-weight Llama of
  SmolLM2-135M's size with 12 heads / 4 KV heads (SmolLM2's own 9 heads do not split in two),
  with SmolLM2's tokenizer. On two cores this measures the overhead of the collectives; the
  gloo all-reduce of one decode step's activations is timed alone too (`--repeats 0`: only it).
gpu (everything GPU-side in one go, for a machine with several GPUs): per size N,
  (a) NCCL all-reduce of one decode step's activations ([batch, hidden], bf16), timed on N
      ranks; a step runs 2 per layer plus one for the embedding;
  (b) `LLM(model, tensor_parallel_size=N)` output tokens/s on the same workload, against N=1.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.config import ModelConfig

from benchmarks.common.machine import CpuWatch, wait_for_quiet

CPU_MODEL_DIR = Path("/tmp/kvpager-bench/tp-llama-135m")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["cpu", "gpu"])
    parser.add_argument("--model", help="checkpoint folder (gpu; cpu builds its own)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="cpu: interleaved rounds")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on gpu")
    parser.add_argument("--quiet-wait", type=float, default=0.0, help="seconds to wait for quiet")
    parser.add_argument("--out", help="write the results here as JSON")
    return parser.parse_args(argv)


def cpu_model() -> Path:
    """Random weights at SmolLM2-135M's size (30 layers, hidden 576 -> 768 for 12 heads)."""
    if (CPU_MODEL_DIR / "config.json").is_file():
        return CPU_MODEL_DIR
    from kvpager.engine.download import resolve_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=768,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(CPU_MODEL_DIR, safe_serialization=True)
    smollm2 = resolve_model("smollm2-135m-instruct", progress=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, CPU_MODEL_DIR / name)
    return CPU_MODEL_DIR


def workload(args, vocab_size: int) -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return prompts, params


def timed_run(path: Path, size: int, threads: int | None, dtype: str, prompts, params) -> dict:
    """One engine start and one timed generate; the LLM is closed after."""
    if threads is not None:
        torch.set_num_threads(threads)  # TP=N on CPU: each rank gets threads // N
    with LLM(str(path), dtype=dtype, tensor_parallel_size=size, max_model_len=1024) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        watch, started = CpuWatch(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds, other_cores = time.perf_counter() - started, watch.other_cores()
    tokens = [o.outputs[0].token_ids for o in outs]
    tok_s = sum(len(t) for t in tokens) / seconds
    return {
        "size": size,
        "seconds": seconds,
        "tok_s": tok_s,
        "other_cores": other_cores,
        "tokens": tokens,
    }


def run_cpu(args) -> dict:
    path, dtype = cpu_model(), args.dtype or "float32"
    prompts, params = workload(args, ModelConfig.from_path(path).vocab_size)
    rounds = []
    for _ in range(args.repeats):  # interleaved: the machine's load hits each alike
        runs = {}
        for name, size, threads in (
            ("tp1_2threads", 1, 2),
            ("tp2_1thread", 2, 2),
            ("tp1_1thread", 1, 1),
        ):
            wait_for_quiet(args.quiet_wait)
            runs[name] = timed_run(path, size, threads, dtype, prompts, params)
        tokens = [run.pop("tokens") for run in runs.values()]
        runs["equal_outputs"] = sum(a == b for a, b in zip(tokens[0], tokens[1]))
        rounds.append(runs)
        print(
            " | ".join(
                f"{name} {run['tok_s']:.1f} tok/s (other cores {run['other_cores']:.2f})"
                for name, run in runs.items()
                if isinstance(run, dict)
            )
            + f" | TP=2 equal to TP=1: {runs['equal_outputs']}/{len(prompts)}"
        )
    config = ModelConfig.from_path(path)
    collectives = all_reduce_us(2, config, "gloo", batches=(1, 32))
    print("gloo, 2 ranks of one thread:")
    print_all_reduce(collectives, config.hidden_size, "fp32")
    return {
        "mode": "cpu",
        "model": str(path),
        "dtype": dtype,
        "rounds": rounds,
        "all_reduce": collectives,
    }


def _all_reduce_worker(rank: int, size: int, port: int, shapes, backend: str, queue) -> None:
    """Median microseconds of one all-reduce per [batch, hidden] shape (fp32 gloo, bf16 NCCL)."""
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    results = {}
    for batch, hidden in shapes:
        x = torch.randn(batch, hidden, dtype=dtype, device=device)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(200):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e6)
        results[batch] = statistics.median(times)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def all_reduce_us(size: int, config: ModelConfig, backend: str, batches=(1, 32, 256)) -> dict:
    """One step runs 2 all-reduces a layer plus the embedding's (and one logits all-gather)."""
    import torch.multiprocessing as mp
    from kvpager.engine.parallel.spawn import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    shapes = [(batch, config.hidden_size) for batch in batches]
    args = (size, free_port(), shapes, backend, queue)
    mp.spawn(_all_reduce_worker, args, nprocs=size, join=True)
    per_call = queue.get()
    calls = 2 * config.num_layers + 1
    return {str(b): {"us": us, "per_step_ms": us * calls / 1000} for b, us in per_call.items()}


def print_all_reduce(figures: dict, hidden: int, dtype: str) -> None:
    for batch, entry in figures.items():
        print(
            f"  all-reduce [{batch}, {hidden}] {dtype}: {entry['us']:.1f} us a call, "
            f"{entry['per_step_ms']:.2f} ms a step"
        )


def run_gpu(args) -> dict:
    if torch.cuda.device_count() < 2:
        print(f"gpu: {torch.cuda.device_count()} CUDA device(s); this needs 2 or more")
        return {"mode": "gpu", "skipped": "fewer than 2 CUDA devices"}
    path, dtype = Path(args.model), args.dtype or "bfloat16"
    config = ModelConfig.from_path(path)
    prompts, params = workload(args, config.vocab_size)
    sizes = [n for n in args.sizes if n <= torch.cuda.device_count()]
    results = {"mode": "gpu", "model": str(path), "dtype": dtype, "sizes": {}}
    for size in sizes:
        entry = timed_run(path, size, None, dtype, prompts, params)
        entry.pop("tokens")
        entry["all_reduce"] = all_reduce_us(size, config, "nccl") if size > 1 else {}
        results["sizes"][str(size)] = entry
        base = results["sizes"][str(sizes[0])]["tok_s"]
        print(f"TP={size}: {entry['tok_s']:.0f} tok/s ({entry['tok_s'] / base:.2f}x TP={sizes[0]})")
        print_all_reduce(entry["all_reduce"], config.hidden_size, "bf16")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = run_cpu(args) if args.mode == "cpu" else run_gpu(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
