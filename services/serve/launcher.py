"""`kvpager serve`: from nothing to a ready API in one command.

    resolve the model (download and convert on first use)  ->  check the checkpoint and that
    the KV cache holds one request  ->  start the embedded nats-server (or probe --nats-url)
    ->  executor, scheduler and tokenizer as `kvpager <name>` children, talking only via NATS
    ->  `kvpager http` (on --http-port, 8000; not with --no-http) and, with --metrics-port,
        `kvpager metrics` children too
    ->  poll llm.health until the executor has attached, and the HTTP ports until they accept
    ->  "ready"  ->  keep them running (services/serve/supervisor.py)  ->  Ctrl-C or SIGTERM
    ->  SIGTERM the services (they drain their streams)  ->  stop the nats-server.

A child that exits during start-up stops everything, with exit status 2 (a set-up problem a
restart would not mend). Once ready, a child that exits or hangs is restarted with backoff;
one that keeps crashing stops everything, with exit status 2, unless each crash came while
it was admitting a request (the children journal that in a private run folder, `journal_dir`:
services/inflight.py). Children run `python -P`: nothing in the caller's folder is imported.
"""

import asyncio
import dataclasses
import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import nats.errors
import structlog
from kvpager.engine.logs import configure_logging
from kvpager.schemas.errors import ConfigError, KvpagerError
from kvpager.services.client import Client, ClientError
from kvpager.services.connection import open_connection
from kvpager.services.http.settings import HttpSettings
from kvpager.services.options import environment
from kvpager.services.serve import processes
from kvpager.services.serve.banner import ready_banner, starting_lines
from kvpager.services.serve.embedded import EmbeddedNats
from kvpager.services.serve.supervisor import Child, Spawn, Supervisor
from kvpager.services.settings import ServeSettings, Settings

SERVICE_NAMES = ("executor", "scheduler", "tokenizer")  # slowest to start first
HTTP_COMMANDS = ("http", "metrics")  # clients of the API: the gateway identity
log = structlog.get_logger(__name__)
POLL_S = 0.25
STOP_MARGIN_S = 15.0


class ServeError(KvpagerError):
    """A service exited or never answered."""

    type = "unavailable"


def serve(
    settings: Settings, options: ServeSettings, embedded: bool, http: HttpSettings | None = None
) -> int:
    """Run until Ctrl-C or SIGTERM; `embedded`: start our own nats-server on loopback."""
    from kvpager.engine.download import resolve_model

    if http is None or not options.http:  # called without HTTP settings: no gateway either
        http = dataclasses.replace(http or HttpSettings(), http_port=None)
    configure_logging(settings.log_level, settings.log_json)
    _check_ports(http)
    path = resolve_model(settings.model, progress=True)  # services get the folder
    _check_checkpoint(settings, path)
    settings = dataclasses.replace(settings, model=str(path))
    return asyncio.run(_serve(settings, options, embedded, http))


def _http_ports(http: HttpSettings) -> dict[str, int]:
    """The HTTP children to start, and their ports."""
    ports = {"http": http.http_port, "metrics": http.metrics_port}
    return {name: port for name, port in ports.items() if port is not None}


def _check_ports(http: HttpSettings) -> None:
    from kvpager.services.http.main import listen

    for name, port in _http_ports(http).items():
        try:
            listen(http.http_host, port).close()
        except ConfigError as exc:  # the gateway is on by default: say how to move or drop it
            hint = "--port PORT, or --no-http" if name == "http" else "another --metrics-port"
            raise ConfigError(f"{exc}; give {hint}") from exc


def check_capacity(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ConfigError(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one request "
            f"of max_model_len {max_model_len} tokens; raise --num-blocks or "
            f"--kv-cache-memory, or lower --max-model-len"
        )


def _check_checkpoint(settings: Settings, path: Path) -> None:
    """Fail before starting anything: unreadable config, no weights, too few blocks."""
    from kvpager.engine.config import EngineConfig
    from kvpager.engine.frontend.tokenizer_files import chat_template_text, tokenizer_folder
    from kvpager.engine.memory import resolve_device
    from kvpager.engine.model.loader import safetensors_files
    from kvpager.engine.model_config import ModelConfig
    from kvpager.engine.parallel.spawn import check_devices

    model_config = ModelConfig.from_path(path)
    safetensors_files(path)
    tokenizer_folder(path, settings.tokenizer)  # the services load it: fail here, once
    if settings.chat_template is not None:
        chat_template_text(settings.chat_template)
    model_config.check_tensor_parallel(settings.tensor_parallel_size)
    check_devices(resolve_device(settings.device), settings.tensor_parallel_size)
    if settings.num_blocks is not None:
        max_len = EngineConfig.pick(settings).model_len(model_config)
        check_capacity(settings.num_blocks, settings.block_size, max_len)


class _Signals:
    """SIGINT and SIGTERM set `event`; `count` tells a second Ctrl-C from the first."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        self.count += 1
        self.event.set()

    async def sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
        except TimeoutError:
            pass


async def _serve(
    settings: Settings, options: ServeSettings, embedded: bool, http: HttpSettings
) -> int:
    signals = _Signals()
    jetstream = http.responses_store == "nats"  # the gateway's stored responses
    server = EmbeddedNats(settings, options, jetstream) if embedded else None
    children: dict[str, Child] = {}
    client = None
    journal_dir = tempfile.mkdtemp(prefix="kvpager-run-")  # 0700: journals name requests
    try:
        settings = dataclasses.replace(settings, journal_dir=journal_dir)
        gateway = settings  # what the HTTP children connect with
        if server is not None:
            settings, gateway = _start_server(server, settings, options)
        client = Client(await open_connection(settings, "kvpager-serve"), settings.prefix)
        _say(*starting_lines(settings, server.process.pid if server else None))
        children = _start_services(settings, http, instance_roles(options), gateway)
        ready = await _wait_ready(client, children, signals, options.ready_timeout)
        if ready and await _wait_listening(http, children, signals, options.ready_timeout):
            stats, max_model_len = await client.stats(), await _max_model_len(client)
            _say(*ready_banner(settings, stats, max_model_len, http))
            timeout_s = settings.liveness_timeout
            supervisor = Supervisor(client.nc, children, timeout_s, journal_dir)
            await _supervise(supervisor, signals, settings.heartbeat_interval)
        return 0
    finally:
        if client is not None:
            await _close(client)
        await _stop_services(children, signals, settings)
        if server is not None:
            server.stop()
        shutil.rmtree(journal_dir, ignore_errors=True)


def _start_server(server: EmbeddedNats, settings: Settings, options: ServeSettings):
    """Start the embedded server; the settings of the services and of the HTTP children."""
    server.start()
    settings = dataclasses.replace(settings, nats_url=server.url)
    if server.nats_dir is None:
        if options.nats_insecure:
            _warn_insecure(server.url)
        return settings, settings
    services = dataclasses.replace(settings, nats_identity=server.identity("service"))
    return services, dataclasses.replace(settings, nats_identity=server.identity("gateway"))


def _warn_insecure(url: str) -> None:
    log.warning("nats without authentication", nats_url=url)
    print(
        f"kvpager: WARNING: --nats-insecure: the NATS server at {url} takes anonymous "
        "connections. Every process on this host can read every prompt and token stream, "
        "abort or forge requests, and reach the internal subjects.",
        file=sys.stderr,
        flush=True,
    )


def instance_roles(options: ServeSettings) -> list[str]:
    """Each instance's role: --prefill-replicas prefill and --decode-replicas decode ones
    (disaggregation), else --replicas that do both."""
    if options.prefill_replicas:
        return ["prefill"] * options.prefill_replicas + ["decode"] * options.decode_replicas
    return ["both"] * options.replicas


def _start_services(
    settings: Settings,
    http: HttpSettings,
    roles: list[str] | None = None,
    gateway: Settings | None = None,
) -> dict[str, Child]:
    """The services; with several instances (`roles`, default one that does both), each
    named `<instance>-0`, `<instance>-1`... or, with roles, `<instance>-prefill-0`,
    `<instance>-decode-0`... (children `executor-<name>`, `scheduler-<name>`).
    The HTTP children connect with `gateway`'s settings (default: `settings`)."""
    spawns = _spawns(settings, http, roles or ["both"], gateway or settings)
    return {name: Child(name, spawn, spawn()) for name, spawn in spawns.items()}


def _spawns(
    settings: Settings, http: HttpSettings, roles: list[str], gateway: Settings
) -> dict[str, Spawn]:
    """How to start (and restart) each child."""
    env = {**os.environ, **environment(settings), **environment(http)}
    gateway_env = {**os.environ, **environment(gateway), **environment(http)}
    spawns = {}
    for child, command, instance, role in _commands(settings, http, roles):
        child_env = gateway_env if command in HTTP_COMMANDS else env
        if instance is not None:
            child_env = {**child_env, "KVPAGER_INSTANCE": instance, "KVPAGER_ROLE": role}
        argv = processes.python_module("kvpager.services.cli", command)  # never the caller's folder
        spawns[child] = functools.partial(processes.spawn, argv, env=child_env)
    return spawns


def _commands(settings: Settings, http: HttpSettings, roles: list[str]):
    """(child name, kvpager command, instance or None, role) for every child, slowest first."""
    if roles == ["both"]:
        return [(name, name, None, "both") for name in (*SERVICE_NAMES, *_http_ports(http))]
    counts: dict[str, int] = {}
    instances = []
    for role in roles:
        number = counts[role] = counts.get(role, -1) + 1
        infix = "" if role == "both" else f"{role}-"
        instances.append((f"{settings.instance}-{infix}{number}", role))
    pairs = [
        (f"{kind}-{name}", kind, name, role)
        for name, role in instances
        for kind in ("executor", "scheduler")
    ]
    others = ("tokenizer", *_http_ports(http))
    return [*pairs, *((name, name, None, "both") for name in others)]


async def _wait_listening(http: HttpSettings, children, signals: _Signals, timeout_s: float):
    """True once every HTTP child accepts connections; False if stopped first."""
    deadline = time.monotonic() + timeout_s
    for port in _http_ports(http).values():
        while not _accepts(http.http_host, port):
            _check_alive(children, " during start-up")
            if signals.event.is_set():
                return False
            if time.monotonic() > deadline:
                raise ServeError(
                    f"nothing listens on {http.http_host}:{port} after {timeout_s:g} s"
                )
            await signals.sleep(POLL_S)
    return not signals.event.is_set()


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


async def _wait_ready(client: Client, children, signals: _Signals, timeout_s: float) -> bool:
    """True once llm.health says ok; False if stopped first; ServeError if a child exits."""
    deadline = time.monotonic() + timeout_s
    while not signals.event.is_set():
        _check_alive(children, " during start-up")
        if await _healthy(client):
            return True
        if time.monotonic() > deadline:
            raise ServeError(f"the services did not become healthy within {timeout_s:g} s")
        await signals.sleep(POLL_S)
    return False


async def _healthy(client: Client) -> bool:
    try:
        return (await client.health(timeout=1.0)).status == "ok"
    except (TimeoutError, ClientError, nats.errors.Error):
        return False  # no tokenizer subscribed yet, or it is busy loading


async def _max_model_len(client: Client) -> int:
    """The served limit; fail if the cache the executor allocated cannot hold it."""
    try:
        stats, models = await client.stats(), await client.models()
    except (TimeoutError, nats.errors.Error) as exc:
        raise ServeError(f"the services answer llm.health but not llm.stats: {exc!r}") from exc
    max_model_len = models.models[0].max_model_len
    check_capacity(stats.num_blocks, stats.block_size, max_model_len)
    return max_model_len


async def _supervise(supervisor: Supervisor, signals: _Signals, interval_s: float) -> None:
    """Once ready: a service that exits or hangs is restarted (services/serve/supervisor.py)."""
    while not signals.event.is_set():
        await supervisor.tick()
        await signals.sleep(interval_s)


def _check_alive(children: dict[str, Child], when: str) -> None:
    for name, child in children.items():
        code = child.process.poll()
        if code is not None:
            raise ServeError(f"the {name} exited with code {code}{when}; see its messages above")


async def _stop_services(children, signals: _Signals, settings: Settings) -> None:
    """SIGTERM all three at once (they drain together); another Ctrl-C kills them."""
    if not children:
        return
    _say("kvpager: stopping the services (Ctrl-C again to kill them)")
    running = [child.process for child in children.values()]
    processes.terminate(running)
    count = signals.count
    deadline = time.monotonic() + settings.drain_timeout + settings.finish_timeout + STOP_MARGIN_S
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        if signals.count > count:  # a signal during shutdown: stop waiting
            break
        await asyncio.sleep(0.1)
    processes.kill(running)


async def _close(client: Client) -> None:
    try:
        await asyncio.wait_for(client.nc.close(), 5.0)
    except (TimeoutError, nats.errors.Error):
        pass


def _say(*lines: str) -> None:
    print("\n".join(lines), flush=True)
