"""Grammars built to crash or flood llguidance, against a default `kvpager serve`: each is a
typed 400 in well under a second, over HTTP and over NATS; the gateway and the tokenizer keep
their pids, and a stream running beside the attacks ends exactly as it does undisturbed."""

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from kvpager.services.client import Client

from tests.engine.structured.test_limits import gbnf_chain, lark_chain, patterns_schema, ref_chain
from tests.services.conftest import wait_all_blocks_free
from tests.services.http_fixture import Served, serving

ATTACKS = {  # the client's field, as vLLM's structured_outputs takes it
    "lark": {"grammar": lark_chain()},
    "gbnf": {"grammar": gbnf_chain()},
    "json-ref-chain": {"json": ref_chain()},
}
QUICK_S = 2.0  # a size check answers in milliseconds; slack for a loaded test machine
VICTIM = dict(prompt="The fox", max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def defaults(tiny_llama, tmp_path_factory) -> Iterator[Served]:
    """`kvpager serve` with default request limits (1 MiB bodies: the attacks fit)."""
    log_dir = tmp_path_factory.mktemp("attacks")
    with serving(tiny_llama, log_dir, 64, {"KVPAGER_CHECK_INVARIANTS": "true"}) as found:
        yield found


@pytest.fixture
async def client(defaults):
    client = await Client.connect(defaults.nats_url)
    yield client
    stats = await wait_all_blocks_free(client, timeout_s=10.0)
    await client.close()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0, stats


def _service(served: Served, name: str) -> psutil.Process:
    for child in psutil.Process(served.process.pid).children():
        argv = child.cmdline()
        if argv and argv[-1] == name:
            return child
    raise AssertionError(f"no {name} child")


async def _victim(client: Client) -> str:
    events = [event async for event in client.generate(**VICTIM)]
    assert events[-1].error is None, events[-1]
    return "".join(event.text for event in events)


async def _over_http(http: httpx.AsyncClient, model: str, spec: dict) -> tuple[int, dict, float]:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "structured_outputs": spec}
    started = time.monotonic()
    answer = await http.post("/v1/completions", json=body)
    return answer.status_code, answer.json(), time.monotonic() - started


async def _over_nats(client: Client, spec: dict) -> tuple[object, float]:
    """The NATS API takes a schema as text."""
    spec = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in spec.items()}
    started = time.monotonic()
    events = [e async for e in client.generate(prompt="hi", max_tokens=4, structured_outputs=spec)]
    return events[-1].error, time.monotonic() - started


async def test_3000_rule_grammars_are_400s_and_kill_nothing(defaults, client):
    pids = {name: _service(defaults, name).pid for name in ("http", "tokenizer")}
    undisturbed = await _victim(client)
    async with httpx.AsyncClient(base_url=defaults.base_url, timeout=30.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        victim = asyncio.create_task(_victim(client))
        for name, spec in ATTACKS.items():
            status, body, took = await _over_http(http, model, spec)
            assert status == 400, (name, body)
            assert body["error"]["param"] == "structured_outputs.grammar" or "json" in str(body)
            assert "--grammar-max-" in body["error"]["message"], (name, body)
            assert took < QUICK_S, (name, took)
            error, took = await _over_nats(client, spec)
            assert error is not None and error.type == "invalid_request", (name, error)
            assert "--grammar-max-" in error.message and took < QUICK_S, (name, error, took)
        assert await victim == undisturbed
    assert {name: _service(defaults, name).pid for name in pids} == pids


async def test_40_patterns_are_refused_quickly_without_memory(defaults, client):
    gateway = _service(defaults, "http")
    before = gateway.memory_info().rss
    spec = {"json": patterns_schema()}
    assert len(json.dumps(spec["json"])) < 2000
    async with httpx.AsyncClient(base_url=defaults.base_url, timeout=30.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(5):
            status, body, took = await _over_http(http, model, spec)
            assert status == 400 and "patterns" in body["error"]["message"], body
            assert took < 1.0, took
    assert gateway.memory_info().rss - before < 100 << 20
    error, took = await _over_nats(client, spec)
    assert error.type == "invalid_request" and took < 1.0, (error, took)


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"type": "integer", "maximum": 1 << 70}},
        {"json": {"type": "integer", "enum": [-(1 << 64)]}},
        {"regex": "a{1000}{1000}"},
    ],
)
async def test_big_integers_and_repetitions_are_400s(defaults, client, spec):
    async with httpx.AsyncClient(base_url=defaults.base_url, timeout=30.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        status, body, _ = await _over_http(http, model, spec)
    assert status == 400, body
    assert body["error"]["param"].startswith("structured_outputs"), body
    error, _ = await _over_nats(client, spec)
    assert error.type == "invalid_request" and error.param.startswith("structured_outputs")


@pytest.mark.parametrize("depth", [200, 3000])
async def test_a_deep_schema_is_a_400_not_a_500(defaults, depth):
    """Nested past the depth limit, and past Python's own recursion (written as text: the
    json module could not encode it)."""
    deep = '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth
    form = '{"type":"json_schema","json_schema":{"name":"deep","schema":' + deep + "}}"
    async with httpx.AsyncClient(base_url=defaults.base_url, timeout=30.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        head = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        body = head[:-1] + ',"response_format":' + form + "}"
        headers = {"content-type": "application/json"}
        answer = await http.post("/v1/chat/completions", content=body, headers=headers)
    assert answer.status_code == 400, answer.text
    if depth < 1000:  # deeper: refused whole by the body's decoder
        assert answer.json()["error"]["param"] == "response_format", answer.text
