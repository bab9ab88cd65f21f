"""Process plumbing shared by the services: logging, NATS connection, uvloop, shutdown."""

import asyncio
import signal
from collections.abc import Callable
from typing import Protocol

import nats
import nats.errors
import structlog
import uvloop
from kvpager.engine.logs import configure_logging
from kvpager.services.connection import connect_options
from kvpager.services.settings import Settings
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)

CONNECT_ATTEMPTS = 60
CONNECT_INTERVAL_S = 0.5


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def setup_logging(settings: Settings, name: str) -> None:
    """JSON lines when stderr is not a tty; every line names the service and instance."""
    configure_logging(settings.log_level, settings.log_json)
    structlog.contextvars.bind_contextvars(service=name, instance=settings.instance)


def run_service(name: str, settings: Settings, build: Callable[[NATS], Service]) -> int:
    """Serve until SIGINT or SIGTERM, then stop the service and drain the connection."""
    return uvloop.run(_serve(name, settings, build))


async def connect(settings: Settings, name: str) -> NATS:
    """Connect, retrying while the server comes up; reconnect for ever afterwards."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=repr(exc))

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    for attempt in range(CONNECT_ATTEMPTS):
        try:
            return await nats.connect(
                settings.nats_servers,
                name=f"kvpager-{name}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                allow_reconnect=True,
                **connect_options(settings),
            )
        except (TimeoutError, OSError, nats.errors.NoServersError):
            if attempt + 1 == CONNECT_ATTEMPTS:
                raise
            await asyncio.sleep(CONNECT_INTERVAL_S)
    raise AssertionError("unreachable")


async def _serve(name: str, settings: Settings, build: Callable[[NATS], Service]) -> int:
    nc = await connect(settings, name)
    service = build(nc)
    await service.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    log.info("serving", nats_url=settings.nats_url, prefix=settings.prefix)
    await stopping.wait()
    log.info("shutting down")
    await service.stop()
    try:  # flush what is pending; without a server, give up after a while
        await asyncio.wait_for(nc.drain(), timeout=5.0)
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("drain failed", error=repr(exc))
        await nc.close()
    log.info("stopped")
    return 0
