"""Concurrent streams through NATS: the client of `kvpager bench serve --backend nats` and of the
load benchmark (benchmarks/serving/load.py) and test (tests/services/test_load.py).

Each stream records when it was sent, its first token and its final event; `problems()` lists
every stream that was lost, failed or differs from an unloaded offline run, and `flood()` sends
more requests at once than running + waiting hold, whose excess must be refused "overloaded".
"""

import asyncio
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpager.services.bench.metrics import RequestOutcome
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


async def ready(url: str, prefix: str, timeout_s: float = 600.0) -> Client:
    """A client of the kvpager at `url` once its services answer healthy."""
    deadline = time.monotonic() + timeout_s
    host, port = url.rsplit("/", 1)[-1].split(":")
    while not listening(host, int(port)):  # else nats-py prints every refused attempt
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {url}")
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


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class NatsBackend:
    """Sends one token-id prompt through kvpager's NATS API, greedy, EOS ignored."""

    client: Client

    async def send(self, prompt_token_ids: list[int], max_tokens: int) -> RequestOutcome:
        outcome = RequestOutcome(len(prompt_token_ids), sent_at=time.perf_counter())
        stream = self.client.generate(
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        async for event in stream:
            if event.token_ids:
                outcome.chunk_times.append(time.perf_counter())
                outcome.num_output_tokens += len(event.token_ids)
            if event.is_final:
                outcome.done_at = time.perf_counter()
                outcome.error = event.error.type if event.error else None
        return outcome
