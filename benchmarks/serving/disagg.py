"""Prefill/decode disaggregation against aggregated serving on the same cores (issue #45).

    python -m benchmarks.serving.disagg                      # SmolLM2, 6000-token prompts
    python -m benchmarks.serving.disagg --model PATH --long 200 --decode-tokens 48 \\
        --num-long 2 --num-blocks 256                         # a smoke run (a tiny model)

Two instances either way, each process on `--threads` threads: aggregated is `kvpager serve
--replicas 2` (both instances prefill and decode, the KV router spreads the requests);
disaggregated is `--prefill-replicas 1 --decode-replicas 1`. `--decode-streams` steady
streams (short prompts, `--decode-tokens` tokens each) run throughout, while `--num-long`
prompts of `--long` random tokens arrive `--gap` seconds apart. Reported per mode: TTFT p50/p99
of the long prompts, and ITL p50/p99 of the steady streams (the stall a long prefill puts on
everyone decoding beside it: what disaggregation removes), from the client's own clock; and
from the instances' stats, the transfer's own cost (blocks, bytes, mean ms per transfer).

The GPU-pair arithmetic: a long prompt's KV bytes (bytes per token, from the transfer's stats)
over `--nixl-gbps` (the NIXL rate between the two GPUs: NVLink, or RDMA across hosts) is the
time its hand-off adds to TTFT on GPUs, printed beside the prompt's KV size.
The numbers that matter come from one quiet run; on a shared host, smoke-run it only.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

from kvpager.engine.download import resolve_model
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats
from kvpager.services.serve.processes import python_module

from benchmarks.serving.nats_peer import free_port, stop

MODES = {
    "aggregated": ["--replicas", "2"],
    "disaggregated": ["--prefill-replicas", "1", "--decode-replicas", "1"],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--long", type=int, default=6000, help="tokens of a long prompt")
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="per process")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-transfer", default="auto", choices=("auto", "nixl", "nats"))
    parser.add_argument("--modes", default="aggregated,disaggregated")
    parser.add_argument("--nixl-gbps", default="25,50,400", help="GB/s between GPU pairs")
    return parser.parse_args(argv)


def start(model: str, port: int, mode: str, args) -> subprocess.Popen:
    env = {
        **os.environ,
        "KVPAGER_MODEL": model,
        "KVPAGER_MAX_MODEL_LEN": str(max(args.long + 64, 512)),
        "KVPAGER_LOG_LEVEL": "warning",
        "KVPAGER_KV_TRANSFER": args.kv_transfer,
        "OMP_NUM_THREADS": str(args.threads),
    }
    if args.num_blocks:
        env["KVPAGER_NUM_BLOCKS"] = str(args.num_blocks)
    argv = ["serve", "--nats-port", str(port), "--no-http", *MODES[mode]]
    return subprocess.Popen(python_module("kvpager.services.cli", *argv), env=env)


async def _healthy(client: Client, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.health(timeout=1.0)).status == "ok":
                stats = await gather_stats(client.nc, "llm.stats", 1.0)
                if len(stats) == 2:
                    return
        except Exception:  # not up yet
            pass
        assert time.monotonic() < deadline, "serve did not become healthy"
        await asyncio.sleep(0.5)


async def _timed(client: Client, prompt: list[int], max_tokens: int) -> list[float]:
    """The arrival time of each token, from the send."""
    sent, times = time.perf_counter(), []
    async for event in client.generate(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
    ):
        assert event.error is None, event.error
        times += [time.perf_counter() - sent] * len(event.token_ids)
    return times


def _pct(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(1000 * statistics.median(ordered), 2), "p99": round(1000 * p99, 2)}


async def measure(port: int, args, vocab_size: int) -> dict:
    client = await Client.connect(f"nats://127.0.0.1:{port}")
    try:
        await _healthy(client)
        rng = random.Random(0)
        top = min(20000, vocab_size)
        ids = lambda n: [rng.randrange(top // 4, top) for _ in range(n)]  # noqa: E731
        await _timed(client, ids(64), 2)  # warm both instances' first steps
        steady = [
            asyncio.ensure_future(_timed(client, ids(32), args.decode_tokens))
            for _ in range(args.decode_streams)
        ]
        await asyncio.sleep(args.gap)
        longs = []
        for _ in range(args.num_long):
            longs.append(asyncio.ensure_future(_timed(client, ids(args.long), 8)))
            await asyncio.sleep(args.gap)
        steady_times, long_times = await asyncio.gather(*steady), await asyncio.gather(*longs)
        await asyncio.sleep(1.0)  # the last hand-offs' stats
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
    finally:
        await client.close()
    itl = [b - a for times in steady_times for a, b in zip(times, times[1:])]
    blocks = sum(s.kv_transfer_blocks for s in stats)
    num_bytes = sum(s.kv_transfer_bytes for s in stats)
    block_size = stats[0].block_size
    moved = [s for s in stats if s.kv_transfer_blocks]
    return {
        "long_ttft_ms": _pct([t[0] for t in long_times]),
        "steady_itl_ms": _pct(itl),
        "long_itl_ms": _pct([b - a for t in long_times for a, b in zip(t, t[1:])]),
        "kv_transfer_blocks": blocks,
        "kv_transfer_bytes": num_bytes,
        "kv_transfer_mean_ms": max((s.kv_transfer_mean_ms for s in moved), default=0.0),
        "kv_bytes_per_token": num_bytes / (blocks * block_size) if blocks else 0,
    }


def gpu_pairs(result: dict, long: int, rates: list[float]) -> list[dict]:
    """The time a `long`-token prompt's KV takes between two GPUs at each NIXL rate."""
    num_bytes = result["kv_bytes_per_token"] * long
    return [
        {"nixl_gbps": rate, "prompt_kv_mb": round(num_bytes / 1e6, 2),
         "transfer_ms": round(1000 * num_bytes / (rate * 1e9), 3)}
        for rate in rates
    ]  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    model = str(resolve_model(args.model))
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rates = [float(r) for r in args.nixl_gbps.split(",")]
    for mode in args.modes.split(","):
        port = free_port()
        server = start(model, port, mode, args)
        try:
            result = asyncio.run(measure(port, args, vocab_size))
        finally:
            stop(server)
        if result["kv_transfer_blocks"]:
            result["gpu_pairs"] = gpu_pairs(result, args.long, rates)
        print(json.dumps({"mode": mode, "long": args.long, **result}), flush=True)


if __name__ == "__main__":
    main()
