"""compose.yaml without Docker: every service's own command and environment, run here.

The containers use the host's network, so the file's commands already point at loopback; the
test sets the port variables to free ports and interpolates them as compose does, and the tiny
test model replaces the volume's model through the environment. A streamed request then goes
through both tokenizer replicas' queue group, the scheduler and the executor, and each health
check must pass, so the compose file cannot drift from the real commands.
"""

import asyncio
import fnmatch
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import yaml
from kvpager.services.cli import build_parser
from kvpager.services.client import Client
from kvpager.services.connection import flush_sent

from tests.nats_server import free_port, nats_server_binary
from tests.services.kvpager_cli import KVPAGER

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
CUDA = yaml.safe_load((ROOT / "compose.cuda.yaml").read_text())
SERVICES = COMPOSE["services"]
# `kvpager http` (the OpenAI gateway) is run once this tree has the command.
HAS_GATEWAY = "http" in build_parser()[1]
LONG_RUNNING = ("tokenizer", "scheduler", "executor", *(("http",) if HAS_GATEWAY else ()))
# ${NAME}, ${NAME:-default} or ${NAME:?error}, as compose interpolates them
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")
# the NATS users' passwords (deploy/nats.conf), which compose requires; a letter first, since
# nats-server parses a variable's value ("12-..." reads as a date, "-..." as a number)
PASSWORDS = {
    f"KVPAGER_{role}_PASSWORD": "kvp-" + secrets.token_urlsafe(24)
    for role in ("SERVICE", "GATEWAY", "CLIENT")
}
CLIENT = {
    "user": "client",
    "password": PASSWORDS["KVPAGER_CLIENT_PASSWORD"],
    "inbox_prefix": "_INBOX_client",
}
# bind mounts ("./deploy/nats.conf:/etc/nats/kvpager.conf:ro"): container path -> ours
MOUNTS = {
    volume.split(":")[1]: str(ROOT / volume.split(":")[0])
    for spec in SERVICES.values()
    for volume in spec.get("volumes", [])
    if volume.startswith("./")
}
# What a container runs by name, and what runs it here.
PROGRAMS = {"kvpager": KVPAGER, "python3": [sys.executable]}


def interpolate(text: str, variables: dict[str, str]) -> str:
    """`text` with compose's variables substituted (unset or empty: the default, or for
    `:?`, compose's error)."""

    def value(match: re.Match) -> str:
        given = variables.get(match[1])
        if not given and match[2] == "?":
            raise ValueError(f"{match[1]} is required: {match[3]}")
        return given or (match[3] if match[2] == "-" else "") or ""

    text = VARIABLE.sub(value, text)
    assert "$" not in text, f"unsupported interpolation in {text!r}"
    return text


@dataclass
class Local:
    """The compose project mapped onto this machine."""

    model: Path
    cache_dir: Path
    log_dir: Path
    nats_port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def localize(self, text: str) -> str:
        """Compose's interpolation with the port variables set, as a user moves the ports."""
        return interpolate(
            text,
            {
                "KVPAGER_NATS_PORT": str(self.nats_port),
                "KVPAGER_NATS_MONITOR_PORT": str(self.monitor_port),
                "KVPAGER_HTTP_PORT": str(self.http_port),
                **PASSWORDS,  # as a user's .env file sets them
            },
        )

    def argv(self, command: list[str]) -> list[str]:
        program, *args = command
        local = [str(nats_server_binary())] if program == "nats-server" else PROGRAMS[program]
        return [*local, *(self._mounted(self.localize(arg)) for arg in args)]

    @staticmethod
    def _mounted(arg: str) -> str:
        for inside, here in MOUNTS.items():
            arg = arg.replace(inside, here)
        return arg

    def env(self, service: str) -> dict[str, str]:
        compose_env = SERVICES[service].get("environment", {})
        local = {name: self.localize(str(value)) for name, value in compose_env.items()}
        # the volume's model and cache, overridden as a user would with an env file
        local |= {"KVPAGER_MODEL": str(self.model), "KVPAGER_CACHE_DIR": str(self.cache_dir)}
        return {**os.environ, **local}

    def start(self, name: str, service: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                self.argv(SERVICES[service]["command"]),
                env=self.env(service),
                stdout=log,
                stderr=log,
            )

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()


def _start_nats(local: Local) -> subprocess.Popen:
    """The nats service's own command: its ports come from the variables."""
    argv = local.argv(SERVICES["nats"]["command"])
    env = local.env("nats")  # the passwords its config reads
    with open(local.log_dir / "nats.log", "wb") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
    for _ in range(500):
        if server.poll() is not None:
            raise RuntimeError(f"nats-server exited at start-up:\n{local.log('nats')}")
        try:
            socket.create_connection(("127.0.0.1", local.nats_port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.02)
    raise TimeoutError("nats-server did not listen")


def _local_nats(tiny_llama, tmp_path_factory, tries: int = 3) -> tuple[Local, subprocess.Popen]:
    """A Local and its nats-server. The free ports are picked, then released, before the
    server binds them: in a loaded run an outgoing connection took one of them once, so a
    server that cannot bind gets fresh ports (its log says why)."""
    for attempt in range(tries):
        logs = tmp_path_factory.mktemp("logs")
        local = Local(tiny_llama, tmp_path_factory.mktemp("cache"), logs)
        try:
            return local, _start_nats(local)
        except RuntimeError:
            if attempt == tries - 1 or "address already in use" not in local.log("nats"):
                raise


@pytest.fixture(scope="module")
def local(tiny_llama, tmp_path_factory) -> Iterator[Local]:
    local, server = _local_nats(tiny_llama, tmp_path_factory)
    try:
        local.start("model", "model")  # the one-shot download: first, as depends_on says
        assert local.processes.pop("model").wait(timeout=60) == 0, local.log("model")
        for service in LONG_RUNNING:
            replicas = SERVICES[service].get("deploy", {}).get("replicas", 1)
            for index in range(replicas):
                local.start(f"{service}-{index + 1}", service)
        asyncio.run(_wait_healthy(local))
        yield local
    finally:
        for process in local.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()
        server.terminate()
        server.wait()


async def _wait_healthy(local: Local, timeout_s: float = 120.0) -> None:
    client = await Client.connect(local.url, **CLIENT)
    try:
        for _ in range(int(timeout_s / 0.2)):
            for name, process in local.processes.items():
                assert process.poll() is None, f"{name} exited:\n{local.log(name)[-2000:]}"
            try:
                if (await client.health(timeout=1.0)).status == "ok":
                    return
            except Exception:  # not up yet
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("the compose services did not become healthy")
    finally:
        await client.close()


def test_every_service_has_a_restart_policy_and_a_health_check():
    for name in ("nats", "tokenizer", "scheduler", "executor", "http"):
        assert SERVICES[name]["restart"] == "unless-stopped", name
        assert SERVICES[name]["healthcheck"]["test"][0] == "CMD", name
    assert SERVICES["tokenizer"]["deploy"]["replicas"] == 2
    for name in ("model", "tokenizer", "executor"):  # the services that read the model
        assert (
            f"models:{SERVICES[name]['environment']['KVPAGER_CACHE_DIR']}"
            in (SERVICES[name]["volumes"])
        )
    for name, spec in SERVICES.items():
        assert set(spec.get("depends_on", {})) <= set(SERVICES), name


def test_host_networking_on_loopback_with_one_set_of_ports():
    """Every container on the host's network, nothing published, everything on 127.0.0.1."""
    for name, spec in SERVICES.items():
        assert spec["network_mode"] == "host" and "ports" not in spec, name
        assert spec["build"]["network"] == "host", name
        assert spec["image"] == "kvpager:cpu", name  # one image, the nats-server too
    nats = [interpolate(arg, {}) for arg in SERVICES["nats"]["command"]]
    assert nats[0] == "nats-server" and "--addr=127.0.0.1" in nats
    # the defaults agree: clients' URL, the server's port, the health checks' hosts
    for name in ("model", *LONG_RUNNING):
        url = interpolate(SERVICES[name]["environment"]["KVPAGER_NATS_URL"], {})
        assert url == "nats://127.0.0.1:4222" and "--port=4222" in nats, name
    assert interpolate(SERVICES["nats"]["healthcheck"]["test"][-1], {}) == (
        "http://127.0.0.1:8222/healthz"
    )
    http = [interpolate(arg, {}) for arg in SERVICES["http"]["command"]]
    assert http[:2] == ["kvpager", "http"] and http[http.index("--http-port") + 1] == "8000"
    assert interpolate(SERVICES["http"]["healthcheck"]["test"][-1], {}) == (
        "http://127.0.0.1:8000/health"
    )


def test_build_arguments_exist_and_the_gpu_goes_to_the_executor():
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    declared = {line.split()[1].split("=")[0] for line in dockerfile if line.startswith("ARG ")}
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile  # users' default base
    dynamo = [
        spec
        for name in ("compose.dynamo.yaml", "compose.dynamo-disagg.yaml")
        for spec in yaml.safe_load((ROOT / name).read_text())["services"].values()
    ]
    for spec in [*SERVICES.values(), *CUDA["services"].values(), *dynamo]:
        assert set(spec.get("build", {}).get("args", {})) <= declared
    base_image = interpolate(SERVICES["model"]["build"]["args"]["BASE_IMAGE"], {})
    assert base_image == "python:3.11-slim"
    assert set(CUDA["services"]) == {"executor"}
    executor = CUDA["services"]["executor"]
    assert executor["build"]["args"]["DEVICE"] == "cuda"
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert all("deploy" not in SERVICES[name] for name in ("scheduler", "executor"))


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern matching the path (or a folder above) wins."""
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.rstrip("/").split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            ignored = not keep
    return ignored


def test_the_image_gets_every_package():
    """What the Dockerfile copies exists, is not .dockerignored, and covers the packages."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    # COPY --from=<stage> copies between build stages, not from the context
    copied = [src for sources in copies if "--from" not in sources[0] for src in sources]
    patterns = (ROOT / ".dockerignore").read_text().split()
    for source in copied:
        assert (ROOT / source).exists() and not _docker_ignored(source, patterns), source
    packages = {"engine", "kernels", "schemas", "services"}  # pyproject's packages.find
    assert packages <= set(copied) and {"pyproject.toml", "README.md"} <= set(copied)
    assert "deploy/wheels/" in copied  # a local torch wheel (deploy/compose-check.sh)
    # the check's venv and logs stay out of the build context
    assert _docker_ignored("deploy/.check/venv", patterns)


# after the letter, what nats-server would read as a date, a negative number, a size or a bool
LETTER_FIRST = ("kvp12-25-ab", "kvp-9x", "k1k", "kvp_true", "kvp007")


@pytest.mark.parametrize("password", LETTER_FIRST)
def test_nats_conf_takes_letter_first_passwords(password):
    """deploy/nats.conf reads the passwords unquoted: the rule it states must be enough."""
    env = {**os.environ, **{name: password for name in PASSWORDS}}
    conf = str(ROOT / "deploy" / "nats.conf")
    check = subprocess.run(
        [str(nats_server_binary()), "-c", conf, "-t"], env=env, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    assert "is valid" in check.stdout + check.stderr


def test_health_checks_pass(local):
    for service in ("nats", *LONG_RUNNING):
        command = SERVICES[service]["healthcheck"]["test"][1:]
        done = subprocess.run(
            local.argv(command), env=local.env(service), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr


async def test_nats_takes_the_users_of_deploy_nats_conf(local):
    """Anonymous clients are refused; the client user may not reach the internal subjects."""
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(local.url, allow_reconnect=False, connect_timeout=2)
    errors = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    client = await nats.connect(local.url, error_cb=on_error, **CLIENT)
    await client.subscribe("llm.internal.>")
    await flush_sent(client)
    await asyncio.sleep(0.2)  # the -ERR comes asynchronously
    await client.close()
    assert any('subscription to "llm.internal.>"' in error for error in errors), errors
    with pytest.raises(ValueError, match="KVPAGER_SERVICE_PASSWORD is required"):
        interpolate(SERVICES["scheduler"]["environment"]["KVPAGER_NATS_PASSWORD"], {})


async def test_a_streamed_request(local):
    client = await Client.connect(local.url, **CLIENT)
    try:
        stream = client.generate(prompt="Once upon a time", max_tokens=8, temperature=0)
        events = [event async for event in stream]
    finally:
        await client.close()
    assert len(events) > 1 and [e.seq for e in events] == list(range(len(events)))
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.num_completion_tokens == 8


@pytest.mark.skipif(not HAS_GATEWAY, reason="no `kvpager http` in this tree yet")
def test_a_completion_streamed_through_the_gateway(local):
    base = f"http://127.0.0.1:{local.http_port}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=10) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    request = urllib.request.Request(
        f"{base}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        lines = [line.strip() for line in reply if line.strip()]
    assert lines[-1] == b"data: [DONE]" and len(lines) > 2, lines


def test_stop_drains_and_exits_zero(local):
    """`docker compose stop` sends SIGTERM (init: true forwards it)."""
    for process in local.processes.values():
        process.send_signal(signal.SIGTERM)
    for name, process in local.processes.items():
        assert process.wait(timeout=60) == 0, local.log(name)[-2000:]


def test_the_replicas_override_runs_two_instances_on_a_three_node_cluster():
    """compose.replicas.yaml over compose.yaml: instances a and b, each service listing every
    node (its own first), the nodes routing to each other, all on the host's loopback."""
    override = yaml.safe_load((ROOT / "compose.replicas.yaml").read_text())["services"]
    merged = {name: {**SERVICES.get(name, {}), **spec} for name, spec in override.items()}
    routes = {arg for name in ("nats", "nats-2", "nats-3") for arg in merged[name]["command"]}
    assert "--routes=nats://127.0.0.1:6222,nats://127.0.0.1:6223,nats://127.0.0.1:6224" in routes
    client_ports = {
        arg.split("=")[1] for name in ("nats", "nats-2", "nats-3")
        for arg in merged[name]["command"] if arg.startswith("--port=")
    }  # fmt: skip
    assert client_ports == {"4222", "4223", "4224"}
    instances = {}
    for name in ("scheduler", "executor", "scheduler-b", "executor-b"):
        env = override[name]["environment"]
        command = merged[name]["command"][1]  # ["kvpager", "scheduler"]
        instances.setdefault(env["KVPAGER_INSTANCE"], set()).add(command)
        assert sorted(env["KVPAGER_NATS_URL"].split(",")) == sorted(
            f"nats://127.0.0.1:{port}" for port in client_ports
        )
    assert instances == {"a": {"scheduler", "executor"}, "b": {"scheduler", "executor"}}
    for name in ("nats-2", "nats-3", "scheduler-b", "executor-b"):
        assert merged[name]["network_mode"] == "host" and merged[name]["image"] == "kvpager:cpu"
