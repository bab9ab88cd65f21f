"""`kvpager serve` keeps its services running once they are ready.

A child that exits, or whose process stops answering the NATS services framework's ping
(`$SRV.PING`, matched to it by the pid in its registration) for `liveness_timeout` seconds
(hung, or SIGSTOPped), is killed if need be and started again after a backoff that doubles
with each recent crash; the other services keep running (a restarted executor attaches to its
scheduler again, a restarted scheduler is found by its executor and tokenizers). A service
that crashes `MAX_CRASHES` times within `CRASH_WINDOW_S` is given up on: ServeError, exit 2.

Those crashes measure the deployment, not its users: a child that dies while admitting a
request (its journal, services/inflight.py, says which) is restarted without the crash
counting, the request's key gets a strike, and a key struck `MAX_STRIKES` times is written
to the poison list the front doors refuse. The streams a dead child owned get a final
`unavailable` event from here, so a raw NATS client never waits for one forever.
"""

import asyncio
import json
import os
import subprocess
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import structlog
from kvpager.schemas.errors import KvpagerError
from kvpager.schemas.public import ORPHANED_SEQ, ErrorInfo, GenerateEvent, Usage
from kvpager.services.inflight import POISON_FILE, journal_path, read_journal
from kvpager.services.wire import encode_public
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)

MAX_CRASHES = 5
CRASH_WINDOW_S = 120.0
BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0
PING_WAIT_S = 0.5
MAX_STRIKES = 2  # crashes a request may cause before it is refused


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
    """`journal_dir`: where the children keep their journals and the poison list goes."""

    def __init__(
        self,
        nc: NATS | None,
        children: dict[str, Child],
        liveness_timeout_s: float,
        journal_dir: str | Path | None = None,
    ) -> None:
        self.nc = nc
        self.children = children
        self.liveness_timeout_s = liveness_timeout_s
        self.journal_dir = None if journal_dir is None else Path(journal_dir)
        self.strikes: Counter[str] = Counter()  # request key -> crashes it was a suspect of
        self.orphans: dict[str, tuple[str, bool]] = {}  # request id -> reply subject, msgpack

    async def tick(self) -> None:
        """Restart what exited (after its backoff) and kill what stopped answering; end the
        streams of the dead."""
        try:
            self.check(time.monotonic(), await self._answering_pids())
        finally:
            await self.end_orphans()

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
            self._lost(child, now, f"exited with code {code}")
        elif child.answered_at is not None and now - child.answered_at > self.liveness_timeout_s:
            child.process.kill()  # hung: its pings went unanswered
            child.process.wait()
            self._lost(child, now, f"did not answer for {self.liveness_timeout_s:g} s")

    def _lost(self, child: Child, now: float, why: str) -> None:
        """Blame the requests it was admitting, if any; else the crash counts."""
        suspects = self._read_journal(child.process.pid)
        if suspects:
            self._strike(suspects)
            why += f" while admitting {len(suspects)} request(s), struck"
        self._crashed(child, now, why, count=not suspects)

    def _read_journal(self, pid: int) -> list[str]:
        """The keys the dead process was admitting; its open streams become orphans."""
        if self.journal_dir is None:
            return []
        path = journal_path(self.journal_dir, pid)
        found = read_journal(path)
        path.unlink(missing_ok=True)
        self.orphans.update(found.streams)
        return found.suspects

    def _strike(self, keys: list[str]) -> None:
        self.strikes.update(set(keys))
        poisoned = sorted(key for key, n in self.strikes.items() if n >= MAX_STRIKES)
        if any(self.strikes[key] == MAX_STRIKES for key in keys):
            log.warning("requests refused from now on", num_keys=len(poisoned))
            path = self.journal_dir / POISON_FILE
            fresh = path.with_suffix(".new")
            fresh.write_text("".join(f"{key}\n" for key in poisoned))
            os.replace(fresh, path)  # the front doors never read half a list

    def _crashed(self, child: Child, now: float, why: str, count: bool = True) -> None:
        if count:
            child.crashes.append(now)
        while child.crashes and child.crashes[0] < now - CRASH_WINDOW_S:
            child.crashes.popleft()
        if len(child.crashes) >= MAX_CRASHES:
            raise CrashLoopError(
                f"the {child.name} {why}, its {len(child.crashes)}th crash in "
                f"{CRASH_WINDOW_S:g} s: giving up"
            )
        backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** max(0, len(child.crashes) - 1))
        child.restart_at = now + backoff
        log.warning("service lost, restarting", service=child.name, reason=why, backoff_s=backoff)
        print(f"kvpager: the {child.name} {why}; restarting it in {backoff:g} s", flush=True)

    def _restart(self, child: Child) -> None:
        child.process = child.start()
        child.restart_at = child.answered_at = None
        log.info("service restarted", service=child.name, pid=child.process.pid)

    async def end_orphans(self) -> None:
        """A final `unavailable` event on each stream a dead child owned."""
        orphans, self.orphans = self.orphans, {}
        for request_id, (reply_to, msgpack) in orphans.items():
            data, headers = encode_public(_orphan_event(request_id), msgpack)
            try:
                await self.nc.publish(reply_to, data, headers=headers)
            except nats.errors.Error as exc:  # closing: the client's idle timeout ends it
                log.warning("final event not sent", request_id=request_id, error=repr(exc))
        if orphans:
            log.warning("streams of a dead service ended", num_streams=len(orphans))

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


def _orphan_event(request_id: str) -> GenerateEvent:
    """The final event of a stream whose owner died: serve does not know its seq."""
    message = "the kvpager service that owned this stream died; the request may be retried"
    return GenerateEvent(
        request_id=request_id,
        seq=ORPHANED_SEQ,
        finish_reason="error",
        error=ErrorInfo("unavailable", message),
        usage=Usage(num_prompt_tokens=0, num_completion_tokens=0, num_cached_prompt_tokens=0),
    )
