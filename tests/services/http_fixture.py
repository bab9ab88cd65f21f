"""`kvpager serve --http-port --metrics-port` on a tiny model, for the HTTP tests."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest

from services.client import Client
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


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory) -> Iterator[Served]:
    nats_port, http_port, metrics_port = free_port(), free_port(), free_port()
    log_dir = tmp_path_factory.mktemp("http")
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(nats_port)]
    args += ["--num-blocks", str(NUM_BLOCKS), "--http-port", str(http_port)]
    args += ["--metrics-port", str(metrics_port)]
    process = start(*args, log_dir=log_dir, env=LIMITS_ENV)
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
