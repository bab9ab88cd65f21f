"""Real services over a real nats-server: three `kvpager` subprocesses per module."""

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import structlog
from kvpager.services.client import Client
from kvpager.services.serve.processes import python_module

from tests.nats_server import nats_server  # noqa: F401  (fixture)

SERVICE_NAMES = ("executor", "scheduler", "tokenizer")
# Small enough that the long-prompt tests travel in pieces and prefill in chunks, and that
# 24 concurrent streams preempt.
SERVICE_ENV = {
    "KVPAGER_PIECE_TOKENS": "64",
    "KVPAGER_MAX_NUM_BATCHED_TOKENS": "256",
    "KVPAGER_NUM_BLOCKS": "48",
    "KVPAGER_BLOCK_SIZE": "16",
    "KVPAGER_CHECK_INVARIANTS": "true",
    "KVPAGER_LOG_JSON": "true",
}


@dataclass
class Services:
    url: str
    prefix: str
    processes: dict[str, subprocess.Popen]
    log_dir: Path
    environ: dict[str, str]

    def launch(self, name: str, command: str | None = None, **env: str) -> None:
        """Start `kvpager <command>` (default: the name), logging to <name>.log; `env`
        overrides this process's environment."""
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                python_module("kvpager.services.cli", command or name),
                env={**self.environ, **env},
                stderr=log,
                stdout=log,
            )

    def wait_healthy(self) -> None:
        try:
            asyncio.run(_wait_healthy(self))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> dict[str, int]:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {}
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
        return codes

    def log_lines(self, name: str) -> list[str]:
        return (self.log_dir / f"{name}.log").read_text().splitlines()


def start_services(
    url: str,
    model: Path,
    log_dir: Path,
    prefix: str = "llm",
    names: tuple[str, ...] = SERVICE_NAMES,
    **env: str,
) -> Services:
    """Start the named services and, if all three are among them, wait until healthy."""
    log_dir.mkdir(parents=True, exist_ok=True)
    environ = {
        **os.environ,
        **SERVICE_ENV,
        **env,
        "KVPAGER_NATS_URL": url,
        "KVPAGER_MODEL": str(model),
        "KVPAGER_PREFIX": prefix,
    }
    services = Services(url, prefix, {}, log_dir, environ)
    for name in names:
        services.launch(name)
    if len(names) == len(SERVICE_NAMES):
        services.wait_healthy()
    return services


async def _wait_healthy(services: Services, timeout_s: float = 120.0) -> None:
    client = await Client.connect(services.url, services.prefix)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for name, process in services.processes.items():
                tail = "\n".join(services.log_lines(name)[-20:])
                assert process.poll() is None, f"{name} exited at start-up:\n{tail}"
            try:
                if (await client.health(timeout=1.0)).status == "ok":
                    return
            except Exception:  # not up yet: no responders or a timeout
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("kvpager services did not become healthy")
    finally:
        await client.close()


def stop_and_check(services: Services) -> None:
    """Graceful shutdown: every service exits 0, and every log line is JSON."""
    codes = services.stop()
    for name in services.processes:
        lines = services.log_lines(name)
        tail = "\n".join(lines[-30:])
        assert codes[name] == 0, f"{name} exited {codes[name]}:\n{tail}"
        for line in lines:
            record = json.loads(line)
            assert name.startswith(record["service"]), line


@pytest.fixture(scope="module")
def services(nats_server, tiny_llama, tmp_path_factory) -> Iterator[Services]:  # noqa: F811
    running = start_services(nats_server.url, tiny_llama, tmp_path_factory.mktemp("logs"))
    yield running
    stop_and_check(running)


async def wait_all_blocks_free(client: Client, timeout_s: float = 5.0):
    """Poll llm.stats until nothing runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await client.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if (idle and stats.num_used_blocks == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


@pytest.fixture
async def client(services) -> AsyncIterator[Client]:
    """A connected client; after the test, every KV block must be free again."""
    connected = await Client.connect(services.url, services.prefix)
    yield connected
    stats = await wait_all_blocks_free(connected)
    await connected.close()
    assert stats.num_used_blocks == 0, stats
    assert stats.num_running == stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_blocks, stats


@pytest.fixture
async def api(served) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client on the module's served gateway (tests/services/http_fixture.py)."""
    client = openai.AsyncOpenAI(base_url=served.api_url, api_key="unused", max_retries=0)
    yield client
    await client.close()


@pytest.fixture
async def model(api) -> str:
    return (await api.models.list()).data[0].id


@pytest.fixture
def restore_logging():
    """In-process CLI calls configure structlog for the process (onto capsys' stream): undo
    that after the test."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    yield
    if configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()
