"""Clients are isolated on NATS (#23): the probe's attacks against a default `kvpager serve`.

The serve runs with its own cache dir, so its identities are this module's. The victim is the
default client identity (what `kvpager generate` uses); the attacker is "mallory", a client
identity of its own from `kvpager credentials add`. Each attack must fail for the attacker,
and the victim's greedy stream must finish equal to an undisturbed run.
"""

import asyncio
import json
import urllib.request
from pathlib import Path

import msgspec
import nats
import pytest
from kvpager.schemas.public import AbortRequest, GenerateRequest
from kvpager.services import credentials
from kvpager.services.client import Client
from kvpager.services.connection import flush_sent

from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, start, wait_for_line

ATTACH = "llm.internal.default.scheduler.attach"  # an executor attaches: a fake fails all
REQUEST = dict(prompt="Once upon a time", temperature=0.0, max_tokens=200, ignore_eos=True)


class Served:
    def __init__(self, url: str, http_url: str, cache: Path) -> None:
        self.url, self.http_url, self.cache = url, http_url, cache
        self.env = {"KVPAGER_CACHE_DIR": str(cache)}

    def identity(self, name: str) -> dict[str, str]:
        return credentials.load(
            self.cache / "nats" / "identities" / f"{name}.json"
        ).connect_options()

    async def connect(self, name: str, errors: list[str] | None = None):
        async def on_error(exc: Exception) -> None:  # the server's -ERR lines
            if errors is not None:
                errors.append(str(exc).lower())

        return await nats.connect(self.url, error_cb=on_error, **self.identity(name))


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    cache, logs = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("serve")
    port, http_port = free_port(), free_port()
    env = {"KVPAGER_CACHE_DIR": str(cache)}
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "64"]
    process = start(*args, "--http-port", str(http_port), log_dir=logs, env=env)
    try:
        wait_for_line(process, logs / "out.txt", "kvpager: ready")
        added = kvpager("credentials", "add", "mallory", env=env)
        assert added.returncode == 0 and "reloaded" in added.stdout, added.stdout + added.stderr
        yield Served(f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", cache)
        assert process.poll() is None, "serve stopped"
        assert "restarting" not in (logs / "out.txt").read_text()  # the gateway answers pings
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


async def test_anonymous_and_wrong_passwords_are_refused(served):
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(served.url, allow_reconnect=False, connect_timeout=2)
    wrong = {**served.identity("mallory"), "password": "guess"}
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(served.url, allow_reconnect=False, connect_timeout=2, **wrong)


def test_commands_work_with_no_setup(served):
    done = kvpager("generate", "Hi", "--max-tokens", "4", "--nats-url", served.url, env=served.env)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    for command in (["stats", "--json"], ["health"]):
        done = kvpager(*command, "--nats-url", served.url, env=served.env)
        assert done.returncode == 0, done.stderr


def test_the_gateway_serves_with_its_own_identity(served):
    models = json.load(urllib.request.urlopen(f"{served.http_url}/v1/models", timeout=10))
    body = {"model": models["data"][0]["id"], "prompt": "Hi", "max_tokens": 4}
    request = urllib.request.Request(
        f"{served.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    answer = json.load(urllib.request.urlopen(request, timeout=30))
    assert answer["usage"]["completion_tokens"] == 4
    metrics = urllib.request.urlopen(f"{served.http_url}/metrics", timeout=10).read().decode()
    assert 'kvpager:num_requests_running{engine="default"}' in metrics  # llm.stats answered


async def _tokens(client: Client, started: asyncio.Event | None = None, **fields):
    """(token ids, finish reason) of one greedy stream; `started` set at its first event."""
    events = []
    async for event in client.generate(**REQUEST, **fields):
        events.append(event)
        if started is not None:
            started.set()
    return [t for event in events for t in event.token_ids], events[-1].finish_reason


def _recorder(subjects: list[str]):
    async def record(msg) -> None:
        subjects.append(msg.subject)

    return record


async def test_a_client_reads_and_forges_nothing(served):
    victim = Client(await served.connect("default"))
    undisturbed = await _tokens(victim)
    errors: list[str] = []
    mallory = await served.connect("mallory", errors)
    service = await served.connect("service")  # sees what reaches the executors' attach
    internal = []
    await service.subscribe(ATTACH, cb=_recorder(internal))
    await flush_sent(service)
    started = asyncio.Event()
    stream = asyncio.create_task(_tokens(victim, started, request_id="victim"))
    await asyncio.wait_for(started.wait(), 30)  # the attacks come while it streams
    sniffed = []
    for subject in ("_INBOX_default.>", "llm.internal.>", ">", "llm.generate", "llm.stats"):
        await mallory.subscribe(subject, cb=_recorder(sniffed))
    await mallory.subscribe("llm.generate", queue="kvpager-tokenizer")  # the queue hijack
    for subject in (ATTACH, "$SRV.PING", "_INBOX_default.x"):
        await mallory.publish(subject, b"\x93\x00\xa1x\xc0")  # a fake ExecutorReady, a ping
    for token in (None, "0" * 22):  # the id is known (X-Request-Id), the token is not
        await mallory.publish("llm.abort", msgspec.json.encode(AbortRequest("victim", token)))
    # a valid request whose reply subject is internal: the services must not answer there
    bait = msgspec.json.encode(GenerateRequest(prompt="x", max_tokens=2))
    await mallory.publish("llm.generate", bait, reply=ATTACH)
    await flush_sent(mallory)
    assert await stream == undisturbed
    assert undisturbed[1] == "length" and len(undisturbed[0]) == REQUEST["max_tokens"]
    await flush_sent(service)
    await asyncio.sleep(0.3)  # -ERR lines come asynchronously
    assert not sniffed and not internal, (sniffed, internal)
    found = "\n".join(errors)
    for subject in ("_inbox_default.>", "llm.internal.>", ">", "llm.generate", "llm.stats"):
        assert f'permissions violation for subscription to "{subject}"' in found, subject
    for subject in ("llm.internal.default.scheduler.attach", "$srv.ping", "_inbox_default.x"):
        assert f'permissions violation for publish to "{subject}"' in found, subject
    stats = await Client(mallory).stats()  # the public subjects still work for mallory
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    for nc in (mallory, service, victim.nc):
        await nc.close()


async def test_the_owner_aborts_and_mallory_streams_on_her_own_inbox(served):
    owner = Client(await served.connect("default"))
    events = []
    async for event in owner.generate(request_id="mine", **{**REQUEST, "max_tokens": 600}):
        events.append(event)
        if len(events) == 2:
            await owner.abort("mine")
    assert events[-1].finish_reason == "abort" and len(events) < 100
    mallory = Client(await served.connect("mallory"))
    raw = msgspec.json.encode(GenerateRequest(**REQUEST))  # no token: the stream brings one
    streamed = [event async for event in mallory.generate_raw(raw)]
    assert streamed[0].abort_token and streamed[-1].finish_reason == "length"
    assert mallory.nc._inbox_prefix == bytearray(b"_INBOX_mallory")
    await owner.close()
    await mallory.close()
