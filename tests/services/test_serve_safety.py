"""`kvpager serve` started from a hostile folder, refusing poisoned requests, and losing its
tokenizer mid-stream.

The folder holds look-alikes of kvpager's packages and of standard modules that write a
marker if imported: serve's children must never import them. A request on serve's poison list
is refused by both front doors. A tokenizer killed with SIGKILL leaves raw NATS streams that
only serve can end: each gets a final `unavailable` event.
"""

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
from kvpager.schemas.public import GenerateRequest
from kvpager.services.client import Client
from kvpager.services.inflight import POISON_FILE, request_key
from kvpager.services.serve.processes import python_module

from tests.nats_server import free_port
from tests.services.kvpager_cli import QUIET_ENV, wait_for_line
from tests.services.test_serve import Served, _child, _generate_after_heal

EVIL = "open({marker!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(7)\n"
LOOK_ALIKES = ("services", "engine", "schemas", "kvpager")
SHADOWED_MODULES = ("resource", "json", "typing", "signal")
JSON = {"Content-Type": "application/json"}


def hostile_folder(folder: Path) -> Path:
    """Packages and modules that leave a line in the returned marker file when imported."""
    marker = folder.parent / f"{folder.name}-imported"
    folder.mkdir(parents=True)
    evil = EVIL.format(marker=str(marker))
    for package in LOOK_ALIKES:
        (folder / package).mkdir()
        for module in ("__init__", "cli", "client"):
            (folder / package / f"{module}.py").write_text(evil)
    for module in SHADOWED_MODULES:
        (folder / f"{module}.py").write_text(evil)
    return marker


@pytest.fixture(scope="module")
def hostile(tiny_llama, tmp_path_factory) -> Iterator[tuple[Served, Path, str]]:
    """serve, run as the installed `kvpager` command runs (its own folder not on sys.path),
    from inside the hostile folder."""
    log_dir = tmp_path_factory.mktemp("serve-hostile")
    marker = hostile_folder(log_dir / "cwd")
    port, http_port = free_port(), free_port()
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "64"]
    args += ["--http-port", str(http_port)]
    env = {**os.environ, **QUIET_ENV, "KVPAGER_LIVENESS_TIMEOUT": "3"}
    env["KVPAGER_HEARTBEAT_INTERVAL"] = "0.5"
    with open(log_dir / "out.txt", "wb") as out, open(log_dir / "err.txt", "wb") as err:
        process = subprocess.Popen(
            python_module("kvpager.services.cli", *args),
            cwd=log_dir / "cwd",
            env=env,
            stdout=out,
            stderr=err,
        )
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        served = Served(process, f"nats://127.0.0.1:{port}", log_dir)
        yield served, marker, f"http://127.0.0.1:{http_port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def test_serve_started_in_a_hostile_folder_runs_none_of_its_code(hostile, tiny_llama):
    served, marker, http_url = hostile
    client = await Client.connect(served.url)
    try:
        events = [e async for e in client.generate(prompt="Hi", max_tokens=4, temperature=0)]
    finally:
        await client.close()
    assert events[-1].finish_reason == "length" and events[-1].error is None
    async with httpx.AsyncClient() as http:
        body = _completion(tiny_llama.name, "Hi")
        answer = await http.post(f"{http_url}/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert not marker.exists(), marker.read_text()


async def test_a_poisoned_request_is_refused_at_both_front_doors(hostile, tiny_llama):
    """The list the supervisor writes after a request's second crash, written here."""
    served, _, http_url = hostile
    model = tiny_llama.name
    tokenizer = psutil.Process(_child(served, "tokenizer").pid)
    journal_dir = Path(tokenizer.environ()["KVPAGER_JOURNAL_DIR"])
    deadly = GenerateRequest(prompt="deadly", max_tokens=3)  # the client adds its ids
    keys = [request_key(msgspec.json.encode(deadly)), request_key(_http_body(model, "deadly"))]
    (journal_dir / POISON_FILE).write_text("".join(f"{key}\n" for key in keys))
    client = await Client.connect(served.url)
    try:
        refused = [e async for e in client.generate(deadly)]
        served_ok = [e async for e in client.generate(prompt="deadly", max_tokens=2)]
    finally:
        await client.close()
    assert len(refused) == 1 and refused[0].error.type == "invalid_request"
    assert "crashed a kvpager service twice" in refused[0].error.message
    assert served_ok[-1].finish_reason == "length"
    async with httpx.AsyncClient() as http:
        url = f"{http_url}/v1/completions"
        reformatted = _http_body(model, "deadly", indent=2)  # the same request, other bytes
        refused_http = await http.post(url, content=reformatted, headers=JSON)
        served_http = await http.post(url, json=_completion(model, "deadly", max_tokens=2))
    assert refused_http.status_code == 400, refused_http.text
    assert refused_http.json()["error"]["code"] == "invalid_request"
    assert served_http.status_code == 200, served_http.text


def _completion(model: str, prompt: str, max_tokens: int = 3) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _http_body(model: str, prompt: str, indent: int | None = None) -> bytes:
    return json.dumps(_completion(model, prompt), indent=indent).encode()


async def test_a_killed_tokenizer_s_raw_streams_get_a_typed_final_event(hostile):
    """The client would wait for 10 minutes; serve ends its streams within seconds, restarts
    the tokenizer, and serves the next request."""
    served, marker, _ = hostile
    tokenizer = _child(served, "tokenizer")
    client = await Client.connect(served.url, idle_timeout=600.0)
    try:
        streams = [
            client.generate(prompt=f"long {i}", max_tokens=900, ignore_eos=True, temperature=0)
            for i in range(3)
        ]
        firsts = [await anext(stream) for stream in streams]  # all three are streaming
        assert all(not event.is_final for event in firsts)
        tokenizer.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        finals = await asyncio.wait_for(asyncio.gather(*map(_final, streams)), 30)
        waited_s = time.monotonic() - killed_at
    finally:
        await client.close()
    assert [(e.error.type, e.finish_reason, e.is_orphaned) for e in finals] == [
        ("unavailable", "error", True)
    ] * 3
    assert waited_s < 10, waited_s
    await asyncio.to_thread(_generate_after_heal, served, tokenizer.pid, "tokenizer")
    assert "kvpager: the tokenizer exited with code -9" in served.output()
    assert served.process.poll() is None and not marker.exists()


async def _final(stream):
    async for event in stream:
        if event.is_final:
            return event
    raise AssertionError("the stream ended without a final event")
