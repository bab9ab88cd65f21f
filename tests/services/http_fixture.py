"""`kvpager serve --http-port --metrics-port` on a tiny model, for the HTTP tests."""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import pytest
from kvpager.services.client import Client

from tests.nats_server import free_port
from tests.services.conftest import wait_all_blocks_free
from tests.services.kvpager_cli import start, wait_for_line

NUM_BLOCKS = 64
LIMITS_ENV = {  # the fuzz test's caps, so that its bad values are bad here too
    "KVPAGER_MAX_REQUEST_BYTES": "16384",
    "KVPAGER_MAX_PROMPT_TOKENS": "400",
    "KVPAGER_MAX_OUTPUT_TOKENS": "900",
    "KVPAGER_MAX_N": "4",
    "KVPAGER_MAX_STOP_STRINGS": "4",
    "KVPAGER_MAX_STOP_STRING_CHARS": "32",
    "KVPAGER_CHECK_INVARIANTS": "true",
}


@dataclass
class Served:
    process: Popen
    nats_url: str
    base_url: str  # the gateway
    metrics_url: str  # the metrics-only server
    log_dir: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def output(self) -> str:
        return (self.log_dir / "out.txt").read_text()


@contextlib.contextmanager
def serving(model: Path, log_dir: Path, num_blocks: int, env: dict[str, str]) -> Iterator[Served]:
    """`kvpager serve` of `model` with its gateway and metrics on free ports, until the end."""
    nats_port, http_port, metrics_port = free_port(), free_port(), free_port()
    args = ["serve", "--model", str(model), "--nats-port", str(nats_port)]
    args += ["--num-blocks", str(num_blocks), "--http-port", str(http_port)]
    args += ["--metrics-port", str(metrics_port)]
    process = start(*args, log_dir=log_dir, env=env)
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        yield Served(
            process,
            f"nats://127.0.0.1:{nats_port}",
            f"http://127.0.0.1:{http_port}",
            f"http://127.0.0.1:{metrics_port}",
            log_dir,
        )
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except Exception:
                process.kill()
        process.wait()


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory) -> Iterator[Served]:
    with serving(tiny_llama, tmp_path_factory.mktemp("http"), NUM_BLOCKS, LIMITS_ENV) as found:
        yield found


@pytest.fixture
async def nats_client(served) -> AsyncIterator[Client]:
    """A NATS client of the same kvpager; after the test every KV block must be free."""
    client = await Client.connect(served.nats_url)
    yield client
    stats = await wait_all_blocks_free(client, timeout_s=10.0)
    await client.close()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks, stats
    assert stats.num_running == stats.num_waiting == 0, stats


async def nats_text(client: Client, **fields) -> tuple[str, object]:
    """Text and usage of one request over NATS."""
    events = [event async for event in client.generate(**fields)]
    assert events[-1].error is None, events[-1]
    return "".join(event.text for event in events), events[-1].usage


async def settle() -> None:
    await asyncio.sleep(0.05)


@dataclass
class Gateway:
    """A `kvpager http` of its own (its own flags) in front of the `served` stack."""

    process: Popen
    base_url: str
    log_dir: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def log_records(self) -> list[dict]:
        """Its JSON log lines so far."""
        lines = (self.log_dir / "err.txt").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]


@contextlib.contextmanager
def gateway(served: Served, model: Path, log_dir: Path, **env: str) -> Iterator[Gateway]:
    """Start `kvpager http` on a free port with `env` (KVPAGER_* settings); stop it after."""
    port = free_port()
    args = ["http", "--model", str(model), "--nats-url", served.nats_url]
    env = {"KVPAGER_LOG_LEVEL": "debug", **env}
    process = start(*args, "--http-port", str(port), log_dir=log_dir, env=env)
    found = Gateway(process, f"http://127.0.0.1:{port}", log_dir)
    try:
        _wait_answering(found)
        yield found
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except Exception:
            process.kill()
            process.wait()


def _wait_answering(found: Gateway, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert found.process.poll() is None, (found.log_dir / "err.txt").read_text()[-3000:]
        try:
            httpx.get(f"{found.base_url}/version", timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError("the gateway did not answer")
