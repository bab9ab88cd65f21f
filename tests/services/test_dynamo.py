"""`kvpager dynamo` workers behind NVIDIA Dynamo's own frontend (`python -m dynamo.frontend
--router-mode kv`): real processes, file discovery, Dynamo's TCP request plane and ZMQ event
plane, each started with its command in compose.dynamo.yaml (the tiny model in place of the
real one). Skipped only when the `kvpager[dynamo]` extra is not installed."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from kvpager.engine.llm import LLM
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.serve.processes import python_module

from tests.nats_server import free_port

pytest.importorskip(
    "dynamo.llm", reason="the dynamo extra is not installed: pip install 'kvpager[dynamo]'"
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.dynamo.yaml").read_text())["services"]
COMPOSE_MODEL = "smollm2-135m-instruct"
NUM_WORKERS = 2
START_TIMEOUT_S = 300.0  # two model loads and Dynamo's start on 2 shared cores
WORKER_FLAGS = ("--num-blocks", "64", "--block-size", "16", "--check-invariants")


def compose_command(service: str, model: Path, port: int) -> list[str]:
    """The service's command in compose.dynamo.yaml, run here: this interpreter, the tiny
    model loaded (served under the compose file's model name), the frontend on `port`."""
    command = [
        str(model) if arg == COMPOSE_MODEL and prev == "--model" else arg
        for prev, arg in zip(["", *COMPOSE[service]["command"]], COMPOSE[service]["command"])
    ]
    command = [arg.replace("${DYNAMO_HTTP_PORT:-8000}", str(port)) for arg in command]
    if command[0] == "python":
        return [sys.executable, "-P", *command[1:]]
    assert command[0] == "kvpager", command
    return [*python_module("kvpager.services.cli", *command[1:]), *WORKER_FLAGS]


PROMPTS = ["The quick brown fox", "Paged attention stores keys", "def add(a, b):"]
# distinct from their first token, each 5+ blocks long: only a cache hit ties them to a worker
PREFIXES = [
    f"{word} once upon a time there was a small language model that liked numbers "
    "0123456789. A scheduler batches many requests continuously, step after step."
    for word in ("Alpha", "Bravo", "Charlie", "Delta")
]


@dataclass
class Deployment:
    url: str
    model: str
    log_dir: Path
    processes: dict[str, subprocess.Popen]

    def worker_lines(self, name: str) -> list[dict]:
        lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def find(self, event: str, request_id: str) -> tuple[str, dict] | None:
        """The worker that logged `event` for the request Dynamo calls `request_id`."""
        for name in self.workers:
            for line in self.worker_lines(name):
                if line.get("event") == event and line["request_id"].startswith(request_id):
                    return name, line
        return None

    @property
    def workers(self) -> list[str]:
        return [name for name in self.processes if name.startswith("worker")]


def _launch(log_dir: Path, name: str, argv: list[str], env: dict) -> subprocess.Popen:
    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=log)


def _wait_ready(deployment: Deployment) -> None:
    """Until the frontend has added every worker to its KV router and lists the model."""
    frontend_log = deployment.log_dir / "frontend.log"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, process in deployment.processes.items():
            if process.poll() is not None:
                log = (deployment.log_dir / f"{name}.log").read_text(errors="replace")
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{log[-3000:]}")
        added = frontend_log.read_text(errors="replace").count("Adding worker WorkerWithDpRank")
        if added >= NUM_WORKERS and _lists_model(deployment):
            return
        time.sleep(1.0)
    raise TimeoutError(f"Dynamo deployment not ready in {START_TIMEOUT_S:.0f} s")


@contextmanager
def started(
    deployment: Deployment, wait_ready: Callable[[Deployment], None]
) -> Iterator[Deployment]:
    """The deployment once ready; its workers must still be up when the `with` ends. Every
    process gets SIGTERM after (Dynamo's graceful shutdown), or a kill after 30 s."""
    processes = deployment.processes
    try:
        wait_ready(deployment)
        yield deployment
        for name in deployment.workers:  # alive to the end: no invariant failed in a step
            assert processes[name].poll() is None, (
                f"{name} died: see {deployment.log_dir}/{name}.log"
            )
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _lists_model(deployment: Deployment) -> bool:
    try:
        models = httpx.get(f"{deployment.url}/v1/models", timeout=5.0).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return any(model["id"] == deployment.model for model in models)


@pytest.fixture(scope="module")
def deployment(tiny_llama, tmp_path_factory) -> Iterator[Deployment]:
    if importlib.util.find_spec("dynamo.frontend") is None:  # the extra alone lacks it
        pytest.fail("Dynamo's frontend is missing: pip install --no-deps ai-dynamo==1.6.1")
    log_dir = tmp_path_factory.mktemp("dynamo")
    env = {
        **os.environ,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(log_dir / "discovery"),
        "NO_COLOR": "1",
        # the KV router's choice and the overlap it saw, per request
        "DYN_LOG": "info,dynamo_llm::kv_router::routing_host::kv_selection=debug",
        "KVPAGER_LOG_JSON": "true",
    }
    port = free_port()
    frontend = compose_command("frontend", tiny_llama, port)
    processes = {"frontend": _launch(log_dir, "frontend", frontend, env)}
    for idx in range(1, NUM_WORKERS + 1):
        argv = compose_command(f"worker-{idx}", tiny_llama, port)
        processes[f"worker{idx}"] = _launch(log_dir, f"worker{idx}", argv, env)
    deployment = Deployment(f"http://127.0.0.1:{port}", COMPOSE_MODEL, log_dir, processes)
    with started(deployment, _wait_ready):
        yield deployment
    for name in deployment.workers:  # SIGTERM: Dynamo's graceful shutdown, then the engine's
        assert processes[name].returncode == 0, f"{name}: see {log_dir}/{name}.log"
        assert any(
            line.get("event") == "dynamo worker stopped" for line in deployment.worker_lines(name)
        )


@pytest.fixture(scope="module")
def offline(tiny_llama) -> Iterator[LLM]:
    with LLM(str(tiny_llama), block_size=16, num_blocks=64) as llm:
        yield llm


def _complete(deployment: Deployment, prompt: str, max_tokens: int) -> dict:
    body = {"model": deployment.model, "prompt": prompt, "max_tokens": max_tokens}
    reply = httpx.post(
        f"{deployment.url}/v1/completions", json={**body, "temperature": 0.0}, timeout=120.0
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _context_id(completion_id: str) -> str:
    """Dynamo's request (context) id, from its completion id `cmpl-<id>`."""
    return re.sub(r"^(cmpl|chatcmpl)-", "", completion_id)


def test_completions_equal_offline_greedy(deployment, offline):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        choice = _complete(deployment, prompt, 16)["choices"][0]
        assert choice["text"] == want.outputs[0].text, prompt
        assert choice["finish_reason"] == want.outputs[0].finish_reason
    offline.check_invariants()


def test_shared_prefix_goes_to_the_worker_that_holds_it(deployment):
    for prefix in PREFIXES:
        first = _complete(deployment, prefix + " one", 2)
        time.sleep(0.5)  # the first one's stored blocks reach the router (ZMQ event plane)
        second = _complete(deployment, prefix + " two", 2)
        holder, _ = _wait_for(deployment, "dynamo request finished", first["id"])
        worker, line = _wait_for(deployment, "dynamo request finished", second["id"])
        assert worker == holder, f"{prefix!r}: routed to {worker}, its prefix is on {holder}"
        assert line["num_cached_tokens"] >= 4 * 16, line
        # the router knew: the overlap it saw came from the workers' KV events (without
        # them it sees 0 blocks and the choice is load's alone)
        assert _routed_overlap(deployment, second["id"]) >= 4


def test_cancel_mid_stream_frees_every_block(deployment):
    prompt = "Once upon a time"
    body = {"model": deployment.model, "prompt": prompt, "max_tokens": 300, "stream": True}
    body["ignore_eos"] = True  # Dynamo's extension: no end token cuts the stream short
    with httpx.stream(
        "POST", f"{deployment.url}/v1/completions", json={**body, "temperature": 0.0}, timeout=60
    ) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data: {"))
        chunks = [json.loads(next(lines)[len("data: ") :]) for _ in range(3)]
    # the client has gone after 3 chunks of 300: the worker aborts and frees at once
    _, aborted = _wait_for(deployment, "dynamo request aborted", chunks[0]["id"])
    assert aborted["num_running"] == 0 and aborted["num_used_blocks"] == 0, aborted
    assert deployment.find("dynamo request finished", _context_id(chunks[0]["id"])) is None
    # the worker serves on
    assert _complete(deployment, "The quick brown fox", 4)["choices"][0]["finish_reason"]


def _routed_overlap(deployment: Deployment, completion_id: str) -> int:
    """The blocks of the request's prefix the KV router saw cached on the worker it chose."""
    log = (deployment.log_dir / "frontend.log").read_text(errors="replace")
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    request_id = re.escape(_context_id(completion_id))
    found = re.search(rf"with (\d+)/\d+ blocks overlap request_id=\"?{request_id}", log)
    assert found, f"the frontend logged no routing decision for {completion_id}"
    return int(found.group(1))


def _wait_for(deployment: Deployment, event: str, completion_id: str) -> tuple[str, dict]:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        found = deployment.find(event, _context_id(completion_id))
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no worker logged {event!r} for {completion_id}")


def test_a_refused_request_gets_an_error_and_the_worker_serves_on(deployment):
    body = {"model": deployment.model, "prompt": "Hello", "max_tokens": 4, "logprobs": 2}
    reply = httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=60.0)
    # an InvalidRequestError is a ValueError: Dynamo answers 400 (its own words), the worker
    # logs ours
    assert reply.status_code == 400, reply.text
    logs = [(deployment.log_dir / f"{name}.log").read_text() for name in deployment.workers]
    assert any("logprobs: not served through the Dynamo worker" in log for log in logs)
    assert _complete(deployment, "Hello", 4)["choices"][0]["finish_reason"]
