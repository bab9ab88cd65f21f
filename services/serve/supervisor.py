"""What keeps `kvpager serve`'s services running once they are ready.

A child that exits is started again after a backoff (0.5 s, doubling up to 8 s, back to
0.5 s after a minute without a crash); the others keep running, and streams on an instance
that went move to another (migration). A child that crashes `MAX_CRASHES` times within
`CRASH_WINDOW_S` is in a crash loop: serve gives up with a clear message (exit status 2).
Start-up is not supervised: a child that exits before ready is a configuration error.
"""

import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from schemas.errors import KvpagerError

log = structlog.get_logger(__name__)

MAX_CRASHES = 5
CRASH_WINDOW_S = 60.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0

Spawn = Callable[[], subprocess.Popen]


class CrashLoopError(KvpagerError):
    """A service keeps exiting: restarting it again would not help."""

    type = "unavailable"


@dataclass
class _Child:
    spawn: Spawn
    crashes: deque[float] = field(default_factory=deque)
    restart_at: float | None = None


class Supervisor:
    def __init__(self, children: dict[str, subprocess.Popen], spawns: dict[str, Spawn]) -> None:
        self.children = children  # the launcher's table: restarted processes replace theirs
        self._state = {name: _Child(spawns[name]) for name in children}

    def check(self, now: float | None = None) -> None:
        """Note exits, restart what is due; raises CrashLoopError on a crash loop."""
        now = time.monotonic() if now is None else now
        for name, child in self._state.items():
            process = self.children[name]
            if child.restart_at is None and process.poll() is not None:
                self._crashed(name, child, process.returncode, now)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                self.children[name] = child.spawn()
                log.warning("service restarted", service=name, pid=self.children[name].pid)

    def _crashed(self, name: str, child: _Child, code: int, now: float) -> None:
        while child.crashes and now - child.crashes[0] > CRASH_WINDOW_S:
            child.crashes.popleft()
        child.crashes.append(now)
        if len(child.crashes) >= MAX_CRASHES:
            raise CrashLoopError(
                f"the {name} exited {len(child.crashes)} times within {CRASH_WINDOW_S:g} s "
                f"(last exit code {code}); giving up"
            )
        backoff = min(FIRST_BACKOFF_S * 2 ** (len(child.crashes) - 1), MAX_BACKOFF_S)
        child.restart_at = now + backoff
        log.warning("service exited: restarting", service=name, code=code, backoff_s=backoff)
