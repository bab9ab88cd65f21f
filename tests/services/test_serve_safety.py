"""`kvpager serve` started from a hostile folder, and losing its tokenizer mid-stream.

The folder holds look-alikes of kvpager's packages and of standard modules that write a
marker if imported: serve's children must never import them. A tokenizer killed with SIGKILL
leaves raw NATS streams that only serve can end: each gets a final `unavailable` event.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.client import Client
from tests.nats_server import free_port
from tests.services.kvpager_cli import QUIET_ENV, wait_for_line
from tests.services.test_serve import Served, _child, _generate_after_heal

EVIL = "open({marker!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(7)\n"
LOOK_ALIKES = ("services", "engine", "schemas", "kvpager")
SHADOWED_MODULES = ("resource", "json", "typing", "signal")


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
def hostile(tiny_llama, tmp_path_factory) -> Iterator[tuple[Served, Path]]:
    """serve, run as the installed `kvpager` command runs (its own folder not on sys.path),
    from inside the hostile folder."""
    log_dir = tmp_path_factory.mktemp("serve-hostile")
    marker = hostile_folder(log_dir / "cwd")
    port = free_port()
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "64"]
    env = {**os.environ, **QUIET_ENV, "KVPAGER_LIVENESS_TIMEOUT": "3"}
    env["KVPAGER_HEARTBEAT_INTERVAL"] = "0.5"
    with open(log_dir / "out.txt", "wb") as out, open(log_dir / "err.txt", "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-P", "-m", "services.cli", *args],
            cwd=log_dir / "cwd",
            env=env,
            stdout=out,
            stderr=err,
        )
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        yield Served(process, f"nats://127.0.0.1:{port}", log_dir), marker
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def test_serve_started_in_a_hostile_folder_runs_none_of_its_code(hostile):
    served, marker = hostile
    client = await Client.connect(served.url)
    try:
        events = [e async for e in client.generate(prompt="Hi", max_tokens=4, temperature=0)]
    finally:
        await client.close()
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert not marker.exists(), marker.read_text()


async def test_a_killed_tokenizer_s_raw_streams_get_a_typed_final_event(hostile):
    """The client would wait for 10 minutes; serve ends its streams within seconds, restarts
    the tokenizer, and serves the next request."""
    served, marker = hostile
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
