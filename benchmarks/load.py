"""Load: hundreds of concurrent streams through NATS against a KV cache too small for them.

    python -m benchmarks.load                                  # tiny random Llama, 2,000 requests
    python -m benchmarks.load --model smollm2-135m-instruct --requests 1000 --num-blocks 512
    python -m benchmarks.load --nats-url nats://host:4222      # a kvpager that already runs

Every request goes out at once (token-id prompts, greedy, `ignore_eos`). Each stream must end
with one final event, its `seq` gap-free (the client checks), and its tokens must equal an
unloaded offline run (`engine.LLM`, same checkpoint). Then a flood past the waiting-queue
bound, whose excess must be answered "overloaded" at once. Prints throughput, latencies,
preemptions (swaps among them) and the overload figures. tests/services/test_load.py runs the
same phases, smaller.
"""

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpager.services.client import Client


@dataclass(frozen=True)
class LoadRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class StreamResult:
    request_id: str
    sent_at: float
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error_type: str | None = None
    first_at: float | None = None  # first token
    done_at: float | None = None  # final event


def make_requests(
    num_requests: int,
    num_prompts: int,
    vocab_size: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (8, 40),
    max_tokens: tuple[int, int] = (8, 32),
    tag: str = "load",
) -> list[LoadRequest]:
    """`num_prompts` distinct prompts shared round-robin (prefix hits), random lengths."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_prompts)
    ]
    return [
        LoadRequest(f"{tag}-{i}", prompts[i % num_prompts], rng.randint(*max_tokens))
        for i in range(num_requests)
    ]


async def run_streams(client: Client, requests: list[LoadRequest]) -> list[StreamResult]:
    """Send every request at once; one result per request, in order."""
    return list(await asyncio.gather(*(_stream(client, request) for request in requests)))


async def _stream(client: Client, request: LoadRequest) -> StreamResult:
    result = StreamResult(request.request_id, sent_at=time.perf_counter())
    stream = client.generate(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        max_tokens=request.max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    async for event in stream:
        if event.token_ids and result.first_at is None:
            result.first_at = time.perf_counter()
        result.token_ids += event.token_ids
        if event.is_final:
            result.done_at = time.perf_counter()
            result.finish_reason = event.finish_reason
            result.error_type = event.error.type if event.error else None
    return result


def expected_tokens(model_path: str | Path, requests: list[LoadRequest]) -> dict[str, list[int]]:
    """Greedy tokens of an unloaded offline run: each distinct prompt once, at its longest."""
    from kvpager.engine import LLM, SamplingParams

    longest: dict[tuple[int, ...], int] = {}
    for request in requests:
        key = tuple(request.prompt_token_ids)
        longest[key] = max(longest.get(key, 0), request.max_tokens)
    prompts = [list(key) for key in longest]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in longest.values()
    ]
    outputs = LLM(str(model_path), seed=0).generate(prompts, params, use_tqdm=False)
    full = {key: out.outputs[0].token_ids for key, out in zip(longest, outputs)}
    return {
        r.request_id: full[tuple(r.prompt_token_ids)][: r.max_tokens] for r in requests
    }  # greedy with ignore_eos: a shorter run is a prefix of the longest


def problems(results: list[StreamResult], expected: dict[str, list[int]]) -> list[str]:
    """Every way a stream went wrong: lost, failed, or tokens unlike the unloaded run."""
    found = []
    for result in results:
        if result.done_at is None:
            found.append(f"{result.request_id}: no final event")
        elif result.error_type is not None or result.finish_reason != "length":
            found.append(f"{result.request_id}: {result.finish_reason} ({result.error_type})")
        elif result.token_ids != expected[result.request_id]:
            found.append(f"{result.request_id}: tokens differ from the unloaded run")
    return found


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: list[StreamResult], wall_s: float) -> dict[str, float]:
    done = [r for r in results if r.done_at is not None and r.error_type is None]
    ttft = [r.first_at - r.sent_at for r in done if r.first_at is not None]
    e2e = [r.done_at - r.sent_at for r in done]
    num_tokens = sum(len(r.token_ids) for r in done)
    return {
        "requests": len(results),
        "completed": len(done),
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(num_tokens / wall_s, 1),
        "requests_per_s": round(len(done) / wall_s, 1),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "e2e_p50_s": round(percentile(e2e, 0.5), 3),
        "e2e_p99_s": round(percentile(e2e, 0.99), 3),
    }


@dataclass
class FloodResult:
    num_sent: int
    num_completed: int
    refusal_s: list[float]  # send to "overloaded" event, per refused request
    other: list[str]  # anything but a completion or an "overloaded" refusal


async def flood(
    client: Client, num: int, vocab_size: int, max_tokens: int = 8, tag: str = "flood"
) -> FloodResult:
    """`num` short requests at once, more than running + waiting can hold."""
    lengths = dict(prompt_len=(4, 8), max_tokens=(max_tokens, max_tokens))
    requests = make_requests(num, num, vocab_size, seed=1, tag=tag, **lengths)
    results = await run_streams(client, requests)
    refused = [r.done_at - r.sent_at for r in results if r.error_type == "overloaded"]
    completed = [r for r in results if r.error_type is None and r.finish_reason == "length"]
    other = [
        f"{r.request_id}: {r.finish_reason} ({r.error_type})"
        for r in results
        if r.error_type not in (None, "overloaded") or r.done_at is None
    ]
    return FloodResult(num, len(completed), refused, other)


# --- the command -------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__)
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
    command = [
        sys.executable,
        "-P",
        "-m",
        "kvpager.services.cli",
        "serve",
        "--nats-port",
        str(port),
        "--no-http",
    ]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


async def _ready(url: str, prefix: str, timeout_s: float = 600.0) -> Client:
    deadline = time.monotonic() + timeout_s
    host, port = url.rsplit("/", 1)[-1].split(":")
    while not _listening(host, int(port)):  # else nats-py prints every refused attempt
        assert time.monotonic() < deadline, f"nothing listens on {url}"
        await asyncio.sleep(0.2)
    client = await Client.connect(url, prefix)
    while time.monotonic() < deadline:
        try:
            if (await client.health(timeout=1.0)).status == "ok":
                return client
        except Exception:  # the services are not up yet
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("kvpager did not become healthy")


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


async def _bench(args: argparse.Namespace, url: str, model: Path | None) -> None:
    client = await _ready(url, args.prefix)
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
