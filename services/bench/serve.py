"""`kvpager bench serve`: drive a running server with a request rate and a concurrency cap.

Requests are sent at Poisson arrival times of `rate` requests/s (all at once when the rate is
infinite), at most `max_concurrency` in flight, each through a backend (HTTP or NATS) that
streams it and stamps its tokens; the summary is `metrics.serve_summary`'s.
"""

import asyncio
import time
from typing import Protocol

from kvpager.services.bench.metrics import RequestOutcome
from kvpager.services.bench.workloads import BenchRequest, TokenSource, arrival_times, uniform


class Backend(Protocol):
    """One streamed request to a server, greedy with EOS ignored."""

    async def send(self, prompt_token_ids: list[int], max_tokens: int) -> RequestOutcome: ...


def random_requests(
    source: TokenSource, num_prompts: int, input_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """`num_prompts` random token-id prompts of exactly `input_len` ids, `output_len` each."""
    lengths = dict(prompt_range=(input_len, input_len), output_range=(output_len, output_len))
    return uniform(source, num_prompts, seed=seed, **lengths).requests


def given_requests(
    prompts: list[list[int]], num_prompts: int, output_len: int
) -> list[BenchRequest]:
    """The given (tokenized) prompts round-robin up to `num_prompts` requests."""
    assert prompts, "at least one prompt"
    return [BenchRequest(prompts[i % len(prompts)], output_len) for i in range(num_prompts)]


async def run_benchmark(
    backend: Backend,
    requests: list[BenchRequest],
    rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
) -> tuple[list[RequestOutcome], float]:
    """Every request's outcome, in order, and the wall seconds from the first send to the last
    final event."""
    offsets = arrival_times(len(requests), rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    started = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestOutcome:
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        if limit is None:
            return await backend.send(request.prompt_token_ids, request.max_tokens)
        async with limit:  # the cap applies after arrival, as in `vllm bench serve`
            return await backend.send(request.prompt_token_ids, request.max_tokens)

    outcomes = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    return list(outcomes), time.perf_counter() - started
