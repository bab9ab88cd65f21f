"""A short request behind a long prefill, with and without vLLM's long_prefill_token_threshold.

    python -m benchmarks.serving.long_prefill [--model smollm2-135m-instruct] [--long 6000]
        [--thresholds 0,512] [--threads 2]

For each threshold a fresh `kvpager serve` (embedded NATS) gets a `--long`-token prompt
(random ids, 1 output token) and, `--gap` seconds later, an 8-token prompt asking for 4 tokens.
It prints the short request's time to first token and the long one's time to its token, both
from their own send, with the host's ISA flags. The report's numbers come from one quiet run.
"""

import argparse
import asyncio
import os
import random
import subprocess
import time

from kvpager.engine.download import resolve_model
from kvpager.kernels.isa import isa_flags
from kvpager.services.client import Client
from kvpager.services.serve.processes import python_module

from benchmarks.serving.nats_peer import free_port, stop


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--long", type=int, default=6000)
    parser.add_argument("--gap", type=float, default=0.5)
    parser.add_argument("--thresholds", default="0,512")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def start(model: str, port: int, threshold: int, threads: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "KVPAGER_MODEL": model,
        "KVPAGER_LONG_PREFILL_TOKEN_THRESHOLD": str(threshold),
        "KVPAGER_MAX_MODEL_LEN": "8192",
        "KVPAGER_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": str(threads),
    }
    command = python_module("kvpager.services.cli", "serve", "--nats-port", str(port), "--no-http")
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


async def first_token_s(client: Client, prompt: list[int], max_tokens: int) -> float:
    sent = time.perf_counter()
    async for event in client.generate(prompt_token_ids=prompt, max_tokens=max_tokens):
        assert event.error is None, event.error
        if event.token_ids:
            return time.perf_counter() - sent
    raise RuntimeError("no token came")


async def measure(port: int, long_len: int, gap: float) -> tuple[float, float]:
    client = await Client.connect(f"nats://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if (await client.health(timeout=1.0)).status == "ok":
                    break
            except Exception:  # not up yet
                pass
            assert time.monotonic() < deadline, "serve did not become healthy"
            await asyncio.sleep(0.5)
        rng = random.Random(0)
        await first_token_s(client, [rng.randrange(100, 40000) for _ in range(64)], 2)  # warm
        long_prompt = [rng.randrange(100, 40000) for _ in range(long_len)]
        long_task = asyncio.ensure_future(first_token_s(client, long_prompt, 1))
        await asyncio.sleep(gap)
        short = await first_token_s(client, [rng.randrange(100, 40000) for _ in range(8)], 4)
        return short, await long_task
    finally:
        await client.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    model = str(resolve_model(args.model))
    print(
        f"isa: {' '.join(isa_flags())}; {args.long}-token prompt, then 8 tokens {args.gap} s later"
    )
    for threshold in map(int, args.thresholds.split(",")):
        port = free_port()
        server = start(model, port, threshold, args.threads)
        try:
            short, long = asyncio.run(measure(port, args.long, args.gap))
        finally:
            stop(server)
        print(
            f"threshold {threshold}: short request TTFT {short:.2f} s, "
            f"long request TTFT {long:.2f} s"
        )


if __name__ == "__main__":
    main()
