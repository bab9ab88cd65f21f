"""Run the `kvpager` command as a user would: a subprocess, its output, its processes."""

import os
import subprocess
import time
from pathlib import Path

import psutil
from kvpager.services.serve.processes import python_module

KVPAGER = python_module("kvpager.services.cli")
QUIET_ENV = {"KVPAGER_LOG_JSON": "true", "KVPAGER_LOG_LEVEL": "warning"}


def kvpager(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """`kvpager <args>` to completion; text stdout and stderr."""
    return subprocess.run(
        [*KVPAGER, *args],
        env={**os.environ, **QUIET_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*args: str, log_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvpager <args>` in the background; stdout to out.txt, stderr to err.txt."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "out.txt", "wb") as out, open(log_dir / "err.txt", "wb") as err:
        return subprocess.Popen(
            [*KVPAGER, *args],
            env={**os.environ, **QUIET_ENV, **(env or {})},
            stdout=out,
            stderr=err,
        )


def wait_for_line(process: subprocess.Popen, path: Path, prefix: str, timeout_s=120) -> str:
    """The first line of `path` starting with `prefix`, while `process` runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if line.startswith(prefix):
                return line
        if process.poll() is not None:
            break
        time.sleep(0.1)
    err = (path.parent / "err.txt").read_text()[-3000:]
    raise AssertionError(f"no {prefix!r} line (exit {process.poll()}):\n{err}")


def processes_on(url: str) -> list[psutil.Process]:
    """Live processes started for `url`: its nats-server (by port) and services (by env)."""
    port = url.rsplit(":", 1)[1]
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = process.cmdline()
            env = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        serving = "nats-server" in " ".join(cmdline[:1]) and port in cmdline
        if serving or env.get("KVPAGER_NATS_URL") == url:
            found.append(process)
    return found
