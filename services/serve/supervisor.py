"""`kvpager serve` keeps its services running once they are ready.

A child that exits, or whose process stops answering the NATS services framework's ping
(`$SRV.PING`, matched to it by the pid in its registration) for `liveness_timeout` seconds
(hung, or SIGSTOPped), is killed if need be and started again after a backoff that doubles
with each recent crash; the other services keep running (a restarted executor attaches to its
scheduler again, a restarted scheduler is found by its executor and tokenizers). A service
that crashes `MAX_CRASHES` times within `CRASH_WINDOW_S` is given up on: ServeError, exit 2.
"""

import asyncio
import json
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from nats.aio.client import Client as NATS

from schemas.errors import KvpagerError

log = structlog.get_logger(__name__)

MAX_CRASHES = 5
CRASH_WINDOW_S = 120.0
BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0
PING_WAIT_S = 0.5


Spawn = Callable[[], subprocess.Popen]


class CrashLoopError(KvpagerError):
    """A service keeps exiting or hanging: restarting it again would not help."""

    type = "unavailable"


@dataclass
class Child:
    """One service process and how to start it again."""

    name: str
    start: Spawn
    process: subprocess.Popen
    crashes: deque[float] = field(default_factory=deque)  # when it exited or hung, recently
    restart_at: float | None = None  # exited: start again then
    answered_at: float | None = None  # its pid last answered $SRV.PING


class Supervisor:
    def __init__(
        self, nc: NATS | None, children: dict[str, Child], liveness_timeout_s: float
    ) -> None:
        self.nc = nc
        self.children = children
        self.liveness_timeout_s = liveness_timeout_s

    async def tick(self) -> None:
        """Restart what exited (after its backoff) and kill what stopped answering."""
        self.check(time.monotonic(), await self._answering_pids())

    def check(self, now: float, answering: frozenset[int] | set[int] = frozenset()) -> None:
        """`answering`: the pids that answered $SRV.PING just now. Raises CrashLoopError."""
        for child in self.children.values():
            if child.process.pid in answering:
                child.answered_at = now
            self._check(child, now)

    def _check(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._restart(child)
            return
        code = child.process.poll()
        if code is not None:
            self._crashed(child, now, f"exited with code {code}")
        elif child.answered_at is not None and now - child.answered_at > self.liveness_timeout_s:
            child.process.kill()  # hung: its pings went unanswered
            child.process.wait()
            self._crashed(child, now, f"did not answer for {self.liveness_timeout_s:g} s")

    def _crashed(self, child: Child, now: float, why: str) -> None:
        child.crashes.append(now)
        while child.crashes and child.crashes[0] < now - CRASH_WINDOW_S:
            child.crashes.popleft()
        if len(child.crashes) >= MAX_CRASHES:
            raise CrashLoopError(
                f"the {child.name} {why}, its {len(child.crashes)}th crash in "
                f"{CRASH_WINDOW_S:g} s: giving up"
            )
        backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (len(child.crashes) - 1))
        child.restart_at = now + backoff
        log.warning("service lost, restarting", service=child.name, reason=why, backoff_s=backoff)
        print(f"kvpager: the {child.name} {why}; restarting it in {backoff:g} s", flush=True)

    def _restart(self, child: Child) -> None:
        child.process = child.start()
        child.restart_at = child.answered_at = None
        log.info("service restarted", service=child.name, pid=child.process.pid)

    async def _answering_pids(self) -> set[int]:
        """Pids of the kvpager processes that answer `$SRV.PING` within PING_WAIT_S."""
        inbox = self.nc.new_inbox()
        pids: set[int] = set()

        async def collect(msg) -> None:
            try:
                pid = json.loads(msg.data).get("metadata", {}).get("pid")
                pids.add(int(pid))
            except (ValueError, TypeError, AttributeError):
                pass  # not one of ours

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish("$SRV.PING", b"", reply=inbox)
            await asyncio.sleep(PING_WAIT_S)
        finally:
            await sub.unsubscribe()
        return pids
