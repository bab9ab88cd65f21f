"""Entry points of `kvpager http` (the OpenAI-compatible gateway, with /metrics) and `kvpager
metrics` (/metrics alone): uvicorn serving a Starlette app over one NATS connection."""

import contextlib
import resource
import signal
import socket
from collections.abc import Iterator

import nats.errors
import structlog
import uvicorn
import uvloop
from kvpager.schemas.errors import ConfigError
from kvpager.services.client import Client
from kvpager.services.connection import with_local_identity
from kvpager.services.credentials import GATEWAY
from kvpager.services.discovery import Discovery
from kvpager.services.http.app import build_app
from kvpager.services.http.gateway import Gateway
from kvpager.services.http.protocol import protocol_class
from kvpager.services.http.settings import HttpSettings
from kvpager.services.runtime import connect, setup_logging
from kvpager.services.settings import Settings

log = structlog.get_logger(__name__)

DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 9090


def run(settings: Settings, http: HttpSettings, metrics_only: bool = False) -> int:
    """Serve until SIGINT or SIGTERM; in-flight requests get `drain_timeout` to finish."""
    name = "metrics" if metrics_only else "http"
    setup_logging(settings, name)
    if metrics_only:
        port = http.metrics_port or DEFAULT_METRICS_PORT
    else:
        port = http.http_port or DEFAULT_HTTP_PORT
    sock = listen(http.http_host, port)
    _raise_open_files(http.http_max_connections)
    return uvloop.run(_serve(settings, http, sock, metrics_only))


class _Server(uvicorn.Server):
    """uvicorn, but a SIGINT or SIGTERM only asks it to stop. uvicorn re-raises the signal
    after its graceful shutdown, so the process would die by it (exit -15); a kvpager service
    drains and exits 0, as `kvpager serve` and compose's restart policy expect."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in stop_signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _raise_open_files(max_connections: int) -> None:
    """Room for every connection the pool admits: a soft RLIMIT_NOFILE of 1024 (a common
    default) would fail accept() before the pool's bound ever applied."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + 256  # NATS, logs, the listening socket
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < wanted:
            log.warning("open files limited", limit=raised, http_max_connections=max_connections)


def listen(host: str, port: int) -> socket.socket:
    """Bind before anything else starts, so a port in use is one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


async def _serve(settings: Settings, http: HttpSettings, sock: socket.socket, metrics_only: bool):
    name = "metrics" if metrics_only else "http"
    settings = with_local_identity(settings, GATEWAY)  # a client of the API, not a service
    nc = await connect(settings, name)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    what = "Prometheus metrics" if metrics_only else "OpenAI-compatible HTTP gateway"
    discovery = await Discovery.register(nc, name, settings, what, url=url)
    gateway = Gateway.create(Client(nc, settings.prefix), settings, http)
    app = build_app(gateway, metrics_only)
    config = uvicorn.Config(
        app,
        http=protocol_class(http.http_header_timeout, http.http_max_connections),
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=http.http_keep_alive_timeout,  # type: ignore[arg-type]  (a float works)
        # no limit_concurrency: it counts connections as requests (Guard bounds requests)
        timeout_graceful_shutdown=int(settings.drain_timeout),
    )
    log.info("listening", url=url, nats_url=settings.nats_url)
    try:
        await _Server(config).serve(sockets=[sock])  # SIGINT / SIGTERM end it
    finally:
        gateway.grammars.close()
        await discovery.stop()
        try:
            await nc.drain()
        except nats.errors.Error as exc:
            log.warning("drain failed", error=repr(exc))
    log.info("stopped")
    return 0
