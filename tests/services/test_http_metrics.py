"""Prometheus metrics (the gateway's /metrics and `kvpager serve --metrics-port`), parsed with
prometheus_client's own parser, and NATS service discovery through `$SRV.PING` / `$SRV.INFO` /
`$SRV.STATS`, the requests `nats micro ls | info | stats` send."""

import json

import httpx
import nats
import openai
import pytest
from kvpager.engine.sched.metrics import Buckets
from kvpager.services import credentials
from kvpager.services.client import Client
from kvpager.services.http.metrics import render
from prometheus_client.parser import text_string_to_metric_families

from tests.services.http_fixture import NUM_BLOCKS, nats_client, served  # noqa: F401

KINDS = ("tokenizer", "scheduler", "executor", "http", "metrics")


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, for every sample of the text."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def _scrape(url: str) -> dict[tuple, float]:
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return _samples(response.text)


ENGINE = (("engine", "default"),)


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"engine": "default", **labels}.items())))]


async def test_counters_move_as_requests_run(served, nats_client: Client):  # noqa: F811
    before = await _scrape(served.base_url)
    assert _value(before, "kvpager:num_blocks") == NUM_BLOCKS
    assert _value(before, "kvpager:kv_cache_usage_perc") == 0.0
    api = openai.AsyncOpenAI(base_url=served.api_url, api_key="unused", max_retries=0)
    model = (await api.models.list()).data[0].id
    done = await api.completions.create(
        model=model, prompt="Count me", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    await api.close()
    after = await _scrape(served.metrics_url)  # the metrics-only server reads the same
    moved = {
        name: _value(after, name) - _value(before, name)
        for name in (
            "kvpager:generation_tokens_total",
            "kvpager:prompt_tokens_total",
            "kvpager:time_to_first_token_seconds_count",
            "kvpager:e2e_request_latency_seconds_count",
            "kvpager:request_queue_time_seconds_count",
            "kvpager:inter_token_latency_seconds_count",
            "kvpager:prefix_cache_queries_total",
        )
    }
    assert moved == {
        "kvpager:generation_tokens_total": 7,
        "kvpager:prompt_tokens_total": done.usage.prompt_tokens,
        "kvpager:time_to_first_token_seconds_count": 1,
        "kvpager:e2e_request_latency_seconds_count": 1,
        "kvpager:request_queue_time_seconds_count": 1,
        "kvpager:inter_token_latency_seconds_count": 6,
        "kvpager:prefix_cache_queries_total": done.usage.prompt_tokens,
    }
    key = ("kvpager:request_success_total", (*ENGINE, ("finished_reason", "length")))
    assert after[key] == before.get(key, 0) + 1
    inf = _value(after, "kvpager:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf == _value(after, "kvpager:time_to_first_token_seconds_count")
    assert _value(after, "kvpager:num_requests_running") == 0


async def test_no_scheduler_means_no_samples():
    """A scrape that hears no instance is still valid text, with no samples."""
    assert _samples(render([]).decode()) == {}


def test_buckets_are_cumulative():
    buckets = Buckets((0.1, 1.0, 10.0))
    for seconds in (0.05, 0.1, 0.5, 20.0):
        buckets.add(seconds)
    histogram = buckets.histogram()
    assert histogram.counts == [2, 3, 3] and histogram.count == 4
    assert histogram.sum == 20.65


# --- NATS service discovery -------------------------------------------------------------------


@pytest.fixture
async def operator(served):  # noqa: F811
    """`nats micro` as an operator runs it: discovery ($SRV) is open to the services' user
    alone (services/credentials.py), whose identity `kvpager serve` made here."""
    service = credentials.load(credentials.identity_path(credentials.SERVICE))
    nc = await nats.connect(served.nats_url, **service.connect_options())
    yield nc
    await nc.close()


async def _gather(nc, subject: str, wait_s: float = 1.0) -> list[dict]:
    """Every answer to one request (the way `nats micro` asks), for `wait_s` seconds."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    answers = []
    try:
        while True:
            answers.append(json.loads((await sub.next_msg(timeout=wait_s)).data))
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return answers


async def test_services_answer_srv_ping(operator):
    pings = await _gather(operator, "$SRV.PING")
    assert sorted(ping["name"] for ping in pings) == sorted(f"kvpager-{k}" for k in KINDS)
    assert all(ping["type"] == "io.nats.micro.v1.ping_response" for ping in pings)
    assert all(ping["metadata"]["instance"] == "default" for ping in pings)
    http = [ping for ping in pings if ping["name"] == "kvpager-http"]
    assert http[0]["metadata"]["url"].startswith("http://127.0.0.1:")


async def test_srv_info_lists_the_endpoints(operator):
    endpoints = {}
    for kind in ("tokenizer", "scheduler", "executor"):
        (info,) = await _gather(operator, f"$SRV.INFO.kvpager-{kind}", wait_s=0.5)
        endpoints[kind] = {e["name"]: (e["subject"], e["queue_group"]) for e in info["endpoints"]}
    tokenizer = endpoints["tokenizer"]
    assert tokenizer["generate"] == ("llm.generate", "kvpager-tokenizer")  # the queue group kept
    assert set(tokenizer) == {"generate", "health", "models", "tokenize", "detokenize"}
    assert endpoints["scheduler"]["stats"][0] == "llm.stats"
    assert endpoints["scheduler"]["stats"][1].startswith("kvpager-scheduler-")  # its own group
    assert endpoints["executor"]["steps"][0] == "llm.internal.default.executor.steps"


async def test_srv_stats_count_requests(nats_client, operator):  # noqa: F811
    async def generates() -> int:
        (stats,) = await _gather(operator, "$SRV.STATS.kvpager-tokenizer", wait_s=0.5)
        return next(e["num_requests"] for e in stats["endpoints"] if e["name"] == "generate")

    before = await generates()
    [event async for event in nats_client.generate(prompt="x", max_tokens=2)]
    assert await generates() == before + 1
