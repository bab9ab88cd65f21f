"""Load: hundreds of concurrent streams through NATS against a KV cache too small for them.

    python -m benchmarks.serving.load                          # tiny random Llama, 2,000 requests
    python -m benchmarks.serving.load --model smollm2-135m-instruct --requests 1000 --num-blocks 512
    python -m benchmarks.serving.load --nats-url nats://host:4222  # a kvpager that already runs

Every request goes out at once (token-id prompts, greedy, `ignore_eos`). Each stream must end
with one final event, its `seq` gap-free (the client checks), and its tokens must equal an
unloaded offline run (`engine.LLM`, same checkpoint). Then a flood past the waiting-queue
bound, whose excess must be answered "overloaded" at once. Prints throughput, latencies,
preemptions (swaps among them) and the overload figures. tests/services/test_load.py runs the
same phases, smaller, with the same client (kvpager.services.bench.load).
"""

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpager.services.bench.load import (
    expected_tokens,
    flood,
    make_requests,
    percentile,
    problems,
    ready,
    run_streams,
    summarize,
)
from kvpager.services.serve.processes import python_module


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.load", description=__doc__)
    parser.add_argument("--model", help="checkpoint folder or name (default: a tiny random Llama)")
    parser.add_argument("--nats-url", help="use a kvpager already serving there")
    parser.add_argument("--prefix", default="llm")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=200, help="distinct prompts")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-waiting", type=int, default=2048)
    parser.add_argument("--swap-space", type=int, default=64 << 20, help="host bytes to swap to")
    parser.add_argument("--flood", type=int, default=3000, help="requests in the flood phase")
    parser.add_argument("--no-check", action="store_true", help="skip the offline comparison")
    return parser.parse_args(argv)


def _serve(args: argparse.Namespace, model: Path, port: int) -> subprocess.Popen:
    """`kvpager serve` with an embedded nats-server, sized by the arguments."""
    env = {
        **os.environ,
        "KVPAGER_MODEL": str(model),
        "KVPAGER_PREFIX": args.prefix,
        "KVPAGER_NUM_BLOCKS": str(args.num_blocks),
        "KVPAGER_BLOCK_SIZE": "16",
        "KVPAGER_MAX_NUM_SEQS": str(args.max_num_seqs),
        "KVPAGER_MAX_WAITING": str(args.max_waiting),
        "KVPAGER_SWAP_SPACE": str(args.swap_space),
        "KVPAGER_PREEMPTION_MODE": "swap",
        "KVPAGER_LOG_LEVEL": "warning",
    }
    command = python_module("kvpager.services.cli", "serve", "--nats-port", str(port), "--no-http")
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


async def _bench(args: argparse.Namespace, url: str, model: Path | None) -> None:
    client = await ready(url, args.prefix)
    vocab_size = (await client.models()).models[0].vocab_size
    requests = make_requests(args.requests, args.prompts, vocab_size)
    started = time.perf_counter()
    results = await run_streams(client, requests)
    figures = summarize(results, time.perf_counter() - started)
    stats = await client.stats()
    print("load:", figures)
    print(f"preemptions: {stats.num_preemptions} ({stats.num_swap_preemptions} swaps)")
    if model is not None and not args.no_check:
        wrong = problems(results, expected_tokens(model, requests))
        print(f"streams unlike the unloaded run or lost: {len(wrong)}", *wrong[:10], sep="\n  ")
    flooded = await flood(client, args.flood, vocab_size)
    print(
        f"flood: {flooded.num_sent} sent, {flooded.num_completed} completed, "
        f"{len(flooded.refusal_s)} overloaded in p50 {percentile(flooded.refusal_s, 0.5):.3f} s "
        f"/ max {max(flooded.refusal_s, default=0.0):.3f} s, {len(flooded.other)} other"
    )
    await client.close()


def _model(name: str | None) -> Path:
    """A checkpoint folder, a known model fetched and converted, or the tests' tiny Llama."""
    if name is None:
        from tests.models import build_llama  # the test suite's seeded random checkpoint

        return build_llama(Path(tempfile.mkdtemp(prefix="kvpager-load-")))
    from kvpager.engine.download import resolve_model

    return Path(name) if Path(name).is_dir() else resolve_model(name, progress=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.nats_url:
        asyncio.run(_bench(args, args.nats_url, _model(args.model) if args.model else None))
        return 0
    model = _model(args.model)
    port = _free_port()
    server = _serve(args, model, port)
    try:
        asyncio.run(_bench(args, f"nats://127.0.0.1:{port}", model))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
