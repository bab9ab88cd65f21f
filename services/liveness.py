"""Liveness between services: a peer that is gone, silent, or reconnected.

Core NATS answers a request to a subject nobody subscribes to with "no responders" at once, so
a killed process is noticed within one ping; a silent peer (hung, overloaded) only after
`liveness_timeout` seconds without an answer. After a reconnect of our own connection,
messages may have been lost both ways, so each service treats what was in flight as lost.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)


class PeerGone(Exception):
    """Nothing subscribes to the peer's subject: its process exited or was killed."""


async def ping(nc: NATS, subject: str, timeout_s: float, payload: bytes = b"") -> Msg | None:
    """The peer's answer, or None if it did not answer in time; raises PeerGone."""
    try:
        return await nc.request(subject, payload, timeout=timeout_s)
    except nats.errors.NoRespondersError as exc:
        raise PeerGone(subject) from exc
    except nats.errors.TimeoutError:
        return None


class Silence:
    """How long a peer has not answered; `note` each ping's outcome."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None

    def note(self, answered: bool) -> bool:
        """Record one ping; True once the peer has been silent for longer than the limit."""
        if answered:
            self._since = None
            return False
        now = time.monotonic()
        self._since = self._since or now
        return now - self._since > self.limit_s


class Reconnects:
    """Notices reconnects of one connection (nats-py counts them)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._seen = nc.stats["reconnects"]

    def take(self) -> bool:
        """True once for every batch of reconnects since the previous call."""
        count = self.nc.stats["reconnects"]
        reconnected, self._seen = count != self._seen, count
        return reconnected


def repeat(interval_s: float, tick: Callable[[], Awaitable[None]]) -> asyncio.Task:
    """Run `tick` now and then every `interval_s` seconds until cancelled; errors are logged."""

    async def loop() -> None:
        while True:
            try:
                await tick()
            except Exception:  # a watchdog that dies silently is worse than a noisy one
                log.exception("liveness check failed")
            await asyncio.sleep(interval_s)

    return asyncio.get_running_loop().create_task(loop())
