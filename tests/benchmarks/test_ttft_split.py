"""serve_bench's TTFT split (benchmarks/serving/ttft_split.py) against a real `kvpager serve`:
the parts read from /metrics add up to what a streaming client measured, none negative."""

import time

import httpx
from kvpager.services.client import Client

from benchmarks.serving.ttft_split import scrape, split
from tests.services.http_fixture import nats_client, served  # noqa: F401


def _client_ttft_ms(base_url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                return 1e3 * (time.perf_counter() - sent)
    raise AssertionError("no chunk with a choice")


async def test_the_parts_add_up_to_the_client_ttft(served, nats_client: Client):  # noqa: F811
    port = int(served.base_url.rsplit(":", 1)[1])
    model = httpx.get(f"{served.base_url}/v1/models").json()["data"][0]["id"]
    before = scrape(port)
    client_ms = [_client_ttft_ms(served.base_url, model, [5 + i, 6, 7, 8, 9] * 8) for i in range(3)]
    after = scrape(port)
    parts = split(before, after, sum(client_ms) / len(client_ms))
    assert parts["client_ttft_mean_ms"] > 0
    assert parts["queue_ms"] >= 0 and parts["prefill_ms"] > 0, parts
    assert parts["hops_ms"] >= 0, parts  # the scheduler's stamps lie inside the client's
    total = parts["hops_ms"] + parts["queue_ms"] + parts["prefill_ms"]
    assert abs(total - parts["client_ttft_mean_ms"]) < 1e-6
    assert parts["steps_per_request"] >= 2  # a prefill step and two decode steps each, at least
