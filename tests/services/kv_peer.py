"""One executor's KV transfer endpoint in a process of its own, driven over stdin/stdout by
tests/services/test_kv_transfer.py: a tiny model's executor with its cache filled with seeded
bytes, its KvEndpoint on NATS (the card published, peers connected as theirs arrive).

    stdin:  {"pull": KvPull as a list}      start the pull
            {"digest": [block ids]}         answer the blocks' sha256
    stdout: {"ready": name} at start, {"pulled": KvPulled}, {"sent": transfer id},
            {"digest": hex}
"""

import argparse
import asyncio
import hashlib
import json
import sys

import msgspec
import nats
import torch
from kvpager.engine import LLM
from kvpager.schemas.kv_transfer import KvPull, KvPulled, KvSent
from kvpager.services.executor import kv_endpoint
from kvpager.services.executor.kv_endpoint import KvEndpoint
from kvpager.services.executor.kv_nats import NatsTransfer
from kvpager.services.settings import Settings


def _say(message: dict) -> None:
    print(json.dumps(message), flush=True)


async def main(args: argparse.Namespace) -> None:
    llm = LLM(
        args.model, dtype="float32", block_size=8, num_blocks=64, attention_backend="torch",
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    executor = llm.runner.executor
    raw = executor.kv_cache.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(args.seed)))  # fmt: skip
    kv_endpoint.PULL_TIMEOUT_S = args.timeout
    nc = await nats.connect(args.nats_url)
    settings = Settings(instance=args.instance)
    if args.backend == "nats":
        kv_endpoint.nixl.available = lambda: False
    transfer = kv_endpoint.make_transfer(executor, settings, nc)
    assert isinstance(transfer, NatsTransfer) == (args.backend == "nats"), transfer

    async def to_scheduler(message: KvPulled | KvSent) -> None:
        if isinstance(message, KvSent):
            _say({"sent": message.transfer_id})
        else:
            fields = ("transfer_id", "num_bytes", "error")
            _say({"pulled": {field: getattr(message, field) for field in fields}})

    endpoint = KvEndpoint(nc, settings, transfer, to_scheduler)
    await endpoint.start()
    await endpoint.announce()
    _say({"ready": endpoint.name, "groups": executor.kv_groups.num_groups})
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        if "pull" in command:
            endpoint.start_pulls([msgspec.convert(command["pull"], KvPull)])
        elif "digest" in command:
            data = transfer.regions.gather(command["digest"])
            _say({"digest": hashlib.sha256(data).hexdigest()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--model", "--nats-url", "--instance", "--backend", "--kv-cache-dtype"):
        parser.add_argument(name, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
