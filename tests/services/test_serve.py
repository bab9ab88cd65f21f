"""`kvpager serve` as a new user runs it: a ready line, `kvpager generate` streaming what the
offline engine generates, `stats` and `health`, and SIGTERM leaving no process behind."""

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import psutil
import pytest
from kvpager.engine import LLM, SamplingParams

from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, processes_on, start, wait_for_line

ORIGIN = "http://app.example"


@dataclass
class Served:
    process: Popen
    url: str
    log_dir: Path
    http_url: str | None = None

    def output(self) -> str:
        return (self.log_dir / "out.txt").read_text()


@contextlib.contextmanager
def serving(
    model, log_dir: Path, env: dict[str, str] | None = None, http: bool = False
) -> Iterator[Served]:
    """`kvpager serve` until ready, killed at the end if it still runs; `http`: with its
    default gateway, on a free port (vLLM's --port) and CORS for one origin."""
    port, http_port = free_port(), free_port()
    args = ["serve", str(model), "--nats-port", str(port), "--num-blocks", "64"]
    args += ["--port", str(http_port), "--allowed-origins", ORIGIN] if http else ["--no-http"]
    process = start(*args, log_dir=log_dir, env=env)
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        http_url = f"http://127.0.0.1:{http_port}" if http else None
        yield Served(process, f"nats://127.0.0.1:{port}", log_dir, http_url)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    with serving(tiny_llama, tmp_path_factory.mktemp("serve"), http=True) as running:
        yield running


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), seed=0)


def test_ready_banner_names_the_api(served):
    lines = served.output().splitlines()
    assert lines[0] == f"kvpager: NATS {served.url} (embedded nats-server, pid {_pid(served)})"
    assert "llm.generate" in served.output() and "llm.stats" in served.output()
    assert f'kvpager generate "Hello" --nats-url {served.url}' in served.output()
    assert "nats req llm.generate '{" in served.output()
    assert lines[-1].startswith(f"kvpager: ready on {served.url}: 64 KV blocks of 16 tokens")


def test_the_gateway_starts_by_default(served):
    """`kvpager serve MODEL --port P`: vLLM's command line, the OpenAI API on P, CORS as asked."""
    assert f"http:     {served.http_url}/v1" in served.output()
    models = httpx.get(f"{served.http_url}/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"], models.text
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{served.http_url}/v1/completions", headers=headers, timeout=10)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = {**headers, "Origin": "http://elsewhere.example"}
    refused = httpx.options(f"{served.http_url}/v1/completions", headers=other, timeout=10)
    assert "access-control-allow-origin" not in refused.headers


def _pid(served: Served) -> int:
    servers = [p for p in psutil.Process(served.process.pid).children() if "nats" in p.name()]
    return servers[0].pid


@pytest.mark.parametrize("chat", [False, True])
def test_generate_streams_the_offline_result(served, offline, chat):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    if chat:
        want = offline.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)
    else:
        want = offline.generate("Hello", params, use_tqdm=False)
    args = ["generate", "Hello", "--max-tokens", "24", "--nats-url", served.url]
    done = kvpager(*args, *(["--chat"] if chat else []))
    assert done.returncode == 0, done.stderr
    assert done.stdout == want[0].outputs[0].text + "\n"


def test_stats_and_health(served):
    done = kvpager("stats", "--nats-url", served.url)
    assert done.returncode == 0, done.stderr
    assert "KV cache:     0 of 64 blocks in use (16 tokens each)" in done.stdout
    figures = json.loads(kvpager("stats", "--json", "--nats-url", served.url).stdout)
    assert figures["num_blocks"] == 64 and figures["num_waiting"] == 0
    health = kvpager("health", "--nats-url", served.url)
    assert health.returncode == 0 and health.stdout.startswith("ok (instance default")


def test_sigterm_stops_every_process(served):
    children = psutil.Process(served.process.pid).children(recursive=True)
    assert len(children) == 5, children  # nats-server, executor, scheduler, tokenizer, http
    assert len(processes_on(served.url)) == 5
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive and not processes_on(served.url)
    assert "kvpager: stopping the services" in served.output()
    assert "Traceback" not in (served.log_dir / "err.txt").read_text()


@pytest.fixture()
def healing(tiny_llama, tmp_path):
    """A serve of its own: these tests kill its children."""
    env = {"KVPAGER_LIVENESS_TIMEOUT": "3", "KVPAGER_HEARTBEAT_INTERVAL": "0.5"}
    with serving(tiny_llama, tmp_path, env) as running:
        yield running


def _child(served: Served, service: str) -> psutil.Process | None:
    """The running child that is `service` (None while it is being restarted)."""
    for child in psutil.Process(served.process.pid).children():
        try:
            argv = child.cmdline()  # empty for a process that has just forked
            if argv and argv[-1] == service and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def _replaced(served: Served, service: str, old_pid: int) -> bool:
    child = _child(served, service)
    return child is not None and child.pid != old_pid


def _healthy(served: Served) -> bool:
    return kvpager("health", "--nats-url", served.url).returncode == 0


def _generate_after_heal(served: Served, old_pid: int, service: str) -> None:
    """The service comes back as a new process, and serves: a completion goes through."""
    deadline = time.monotonic() + 90
    while not _replaced(served, service, old_pid) or not _healthy(served):
        assert time.monotonic() < deadline, "not restarted and healthy again within 90 s"
        time.sleep(0.5)
    done = kvpager("generate", "Hi", "--max-tokens", "4", "--nats-url", served.url, timeout=90)
    assert done.returncode == 0, done.stderr
    assert served.process.poll() is None  # serve itself kept running


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_serve_restarts_a_lost_executor(healing, how):
    """SIGKILL: it exited. SIGSTOP: it stopped answering $SRV.PING and is killed first."""
    executor = _child(healing, "executor")
    scheduler_pid = _child(healing, "scheduler").pid
    executor.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    wait_for_line(healing.process, healing.log_dir / "out.txt", "kvpager: the executor", 60)
    _generate_after_heal(healing, executor.pid, "executor")
    assert _child(healing, "scheduler").pid == scheduler_pid  # the others kept running


def test_serve_gives_up_on_a_service_that_keeps_crashing(healing):
    for _ in range(5):
        tokenizer = _child(healing, "tokenizer")
        tokenizer.kill()
        psutil.wait_procs([tokenizer], timeout=10)
        deadline = time.monotonic() + 30  # wait for the restart before the next kill
        while healing.process.poll() is None and time.monotonic() < deadline:
            if _child(healing, "tokenizer") is not None:
                break  # restarted
            time.sleep(0.2)
    assert healing.process.wait(timeout=60) == 2
    assert "giving up" in (healing.log_dir / "err.txt").read_text()
