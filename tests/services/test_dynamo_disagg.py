"""`kvpager dynamo --disaggregation-mode prefill|decode` behind Dynamo's own frontend: one
prefill and one decode worker, each started with its command in compose.dynamo-disagg.yaml
(the tiny model in place of the real one). Every request is prefilled on one, its blocks read
over NIXL by the other, which streams the rest: the completions equal offline greedy, the
decode worker counts the blocks it received, and every block is free on both afterwards.
Skipped only when the `kvpager[dynamo]` or `kvpager[nixl]` extra is not installed."""

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kvpager.engine.llm import LLM
from kvpager.schemas.sampling import SamplingParams

from tests.nats_server import free_port

pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed")
pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

from tests.services.test_dynamo import (  # noqa: E402  (after the skips)
    PREFIXES,
    PROMPTS,
    WORKER_FLAGS,
    Deployment,
    _complete,
    _context_id,
    _launch,
    _lists_model,
    started,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.dynamo-disagg.yaml").read_text())["services"]
COMPOSE_MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 300.0


def compose_command(service: str, model: Path, port: int) -> list[str]:
    import sys

    from kvpager.services.serve.processes import python_module

    command = [
        str(model) if arg == COMPOSE_MODEL and prev == "--model" else arg
        for prev, arg in zip(["", *COMPOSE[service]["command"]], COMPOSE[service]["command"])
    ]
    command = [arg.replace("${DYNAMO_HTTP_PORT:-8000}", str(port)) for arg in command]
    if command[0] == "python":
        return [sys.executable, "-P", *command[1:]]
    return [*python_module("kvpager.services.cli", *command[1:]), *WORKER_FLAGS]


def _wait_ready(deployment: Deployment) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, process in deployment.processes.items():
            if process.poll() is not None:
                log = (deployment.log_dir / f"{name}.log").read_text(errors="replace")
                raise RuntimeError(f"{name} exited ({process.returncode}):\n{log[-3000:]}")
        ready = all(
            any(line.get("event") == "dynamo worker ready" for line in deployment.worker_lines(n))
            for n in deployment.workers
        )
        if ready and _lists_model(deployment):
            return
        time.sleep(1.0)
    raise TimeoutError(f"Dynamo deployment not ready in {START_TIMEOUT_S:.0f} s")


@pytest.fixture(scope="module")
def deployment(tiny_llama, tmp_path_factory) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("dynamo-disagg")
    env = {
        **os.environ,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(log_dir / "discovery"),
        "NO_COLOR": "1",
        "KVPAGER_LOG_JSON": "true",
    }
    port = free_port()
    processes = {}
    for service, name in (
        ("frontend", "frontend"),
        ("prefill", "worker-p"),
        ("decode", "worker-d"),
    ):
        argv = compose_command(service, tiny_llama, port)
        processes[name] = _launch(log_dir, name, argv, env)
    deployment = Deployment(f"http://127.0.0.1:{port}", COMPOSE_MODEL, log_dir, processes)
    with started(deployment, _wait_ready):
        yield deployment


def test_disaggregated_completions_equal_offline_greedy_and_free_every_block(
    deployment, tiny_llama
):
    prompts = [*PROMPTS, PREFIXES[0]]  # the last one 5+ blocks long
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(str(tiny_llama), block_size=16, num_blocks=64) as offline:
        expected = offline.generate(prompts, params, use_tqdm=False)
    num_transferred = 0  # the decode worker's count so far
    for prompt, want in zip(prompts, expected):
        reply = _complete(deployment, prompt, 16)
        choice = reply["choices"][0]
        assert choice["text"] == want.outputs[0].text, prompt
        assert choice["finish_reason"] == want.outputs[0].finish_reason
        # the prompt went through the prefill worker, which held its blocks for the decode side
        held = _line(deployment, "worker-p", "dynamo prefill held", reply["id"])
        done = _line(deployment, "worker-d", "dynamo request finished", reply["id"])
        # the decode side read them (its count grows) and freed its own at the end
        num_read = done["kv_transfer_blocks"] - num_transferred
        assert 0 < num_read <= held["num_blocks"], (held, done)  # the last token's: recomputed
        num_transferred = done["kv_transfer_blocks"]
        assert done["num_used_blocks"] == 0, done
        # its read notified the prefill worker, which freed the held blocks
        released = _released(deployment, held["transfer_id"])
        assert released["num_used_blocks"] == 0, released
    lines = deployment.worker_lines("worker-d")
    pulled = [line for line in lines if line.get("event") == "kv pulled"]
    assert len(pulled) == len(prompts) and all(line["num_bytes"] > 0 for line in pulled)


def _line(deployment: Deployment, worker: str, event: str, completion_id: str) -> dict:
    """The line `worker` logged for `event` of the request Dynamo calls `completion_id`."""
    request_id = _context_id(completion_id)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for line in deployment.worker_lines(worker):
            if line.get("event") == event and line["request_id"].startswith(request_id):
                return line
        time.sleep(0.2)
    raise AssertionError(f"{worker} logged no {event!r} for {completion_id}")


def _released(deployment: Deployment, transfer_id: str) -> dict:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for line in deployment.worker_lines("worker-p"):
            if line.get("event") == "kv hold released" and line["transfer_id"] == transfer_id:
                return line
        time.sleep(0.2)
    raise AssertionError(f"the prefill worker never freed the blocks of {transfer_id}")
