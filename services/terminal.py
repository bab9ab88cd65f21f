"""Client commands for the terminal: `kvpager generate`, `kvpager stats`, `kvpager health`.

Each connects once with the settings' URL and credentials and talks to the public API through
services.client; none imports torch, so they start in a fraction of a second.
"""

import asyncio
import sys
from contextlib import aclosing

import msgspec
import nats.errors
from kvpager.schemas.kv_transfer import DrainInstance, DrainResult
from kvpager.schemas.public import ChatMessage, GenerateEvent, GenerateRequest, Stats
from kvpager.services import credentials
from kvpager.services.client import Client
from kvpager.services.connection import open_connection, with_local_identity
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack


async def _client(settings: Settings) -> Client:
    return Client(await open_connection(settings, "kvpager-cli"), settings.prefix)


def request_for(prompt: str, chat: bool, **sampling) -> GenerateRequest:
    if chat:
        return GenerateRequest(messages=[ChatMessage("user", prompt)], **sampling)
    return GenerateRequest(prompt=prompt, **sampling)


async def generate(settings: Settings, request: GenerateRequest) -> int:
    """Print the text as it streams in; 1 if the request failed."""
    client = await _client(settings)
    final: GenerateEvent | None = None
    try:
        async with aclosing(client.generate(request)) as events:  # early exit: abort
            async for event in events:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                final = event
    finally:
        await client.close()
    sys.stdout.write("\n")
    if final is not None and final.error is not None:
        print(f"kvpager: {final.error.type}: {final.error.message}", file=sys.stderr)
        return 1
    return 0


async def stats(settings: Settings, as_json: bool, watch_s: float | None) -> int:
    """Print `llm.stats` once, or every `watch_s` seconds until Ctrl-C."""
    client = await _client(settings)
    try:
        while True:
            figures = await client.stats()
            print(msgspec.json.encode(figures).decode() if as_json else format_stats(figures))
            if watch_s is None:
                return 0
            await asyncio.sleep(watch_s)
            print(flush=True)
    finally:
        await client.close()


async def health(settings: Settings, timeout_s: float) -> int:
    """0 when a tokenizer, the scheduler and its executor all answer (a health check)."""
    client = await _client(settings)
    try:
        answer = await client.health(timeout=timeout_s)
    finally:
        await client.close()
    detail = f": {answer.message}" if answer.message else ""
    print(f"{answer.status} (instance {answer.instance}, model {answer.model}){detail}")
    return 0 if answer.status == "ok" else 1


async def drain(settings: Settings, instance: str, timeout_s: float) -> int:
    """`kvpager drain INSTANCE`: its streams move on with their KV blocks (services/
    scheduler/drain.py); 0 once the instance answered. An internal subject: without
    credentials given, this host's services identity (a `kvpager serve` made one)."""
    settings = with_local_identity(settings, credentials.SERVICE)
    client = Client(await open_connection(settings, "kvpager-drain"), settings.prefix)
    subject = Subjects(settings.prefix, instance).scheduler_drain
    try:
        reply = await client.nc.request(subject, pack(DrainInstance(instance)), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        print(f"no instance {instance!r} answers", file=sys.stderr)
        return 1
    finally:
        await client.close()
    result = msgspec.msgpack.decode(reply.data, type=DrainResult)
    print(f"instance {instance} drains: {result.num_moved} streams moved with their KV blocks")
    return 0


def format_stats(stats: Stats) -> str:
    finished = ", ".join(f"{k} {v}" for k, v in sorted(stats.num_finished.items())) or "none"
    return "\n".join(
        [
            f"instance {stats.instance}",
            f"KV cache:     {stats.num_used_blocks} of {stats.num_blocks} blocks in use "
            f"({stats.block_size} tokens each), {stats.num_free_blocks} free, "
            f"{stats.num_cached_blocks} of them holding cached prefixes",
            f"queues:       {stats.num_running} running, {stats.num_waiting} waiting, "
            f"{stats.num_preemptions} preemptions",
            f"finished:     {finished}",
            f"prefix cache: {stats.prefix_cache_hit_rate:.1%} hit rate "
            f"({stats.prefix_cache_hit_tokens} of {stats.prefix_cache_queried_tokens} tokens)",
            f"throughput:   {stats.tokens_per_s:.1f} tokens/s, {stats.num_generated_tokens} "
            f"tokens in {stats.num_steps} steps",
            f"latency (ms): TTFT p50 {stats.ttft_ms.p50:.1f} p99 {stats.ttft_ms.p99:.1f}, "
            f"ITL p50 {stats.itl_ms.p50:.1f} p99 {stats.itl_ms.p99:.1f}, "
            f"step p50 {stats.step_ms.p50:.1f} p99 {stats.step_ms.p99:.1f}",
        ]
    )
