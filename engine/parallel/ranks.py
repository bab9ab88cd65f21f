"""Ranks: rank 0's end of a tensor-parallel group, the part that keeps the other ranks in step.

Every step and reset goes to every rank before rank 0 runs it, under one lock that also covers
the step's collectives; while rank 0 idles, a keepalive goes out every `interval_s`, so ranks
waiting for the next step stay inside the group's timeout and a dead or hung rank is found
between steps as well. Any failure inside a step or a keepalive loses the whole group: the ranks
can no longer be trusted to agree, so the executor fails as one (`ExecutorUnavailableError`).
"""

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog
from kvpager.engine.parallel.group import TensorParallel
from kvpager.schemas.errors import ExecutorUnavailableError
from kvpager.schemas.executor import RankKeepalive, RankMessage, RankShutdown

log = structlog.get_logger(__name__)

SHUTDOWN_WAIT_S = 10.0


class Ranks:
    def __init__(
        self,
        group: TensorParallel,
        processes: list[subprocess.Popen],
        interval_s: float,
    ) -> None:
        self.group = group
        self.processes = processes  # the ranks this process started (none under torchrun)
        self.interval_s = interval_s
        self.lost: str | None = None  # why the group failed
        # called once, from the keepalive thread, when the group fails while rank 0 idles
        self.on_lost: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="kvpager-ranks", daemon=True)

    def start(self) -> None:
        """Begin keepalives (every rank has built its executor)."""
        self._thread.start()

    @contextmanager
    def running(self, message: RankMessage) -> Iterator[None]:
        """Send `message` to every rank, then run the body (rank 0's part) with no keepalive
        in between; any failure loses the group."""
        with self._lock:
            self.check_alive()
            try:
                self.group.send(message)
                yield
            except Exception as exc:
                self._lose(f"{type(message).__name__}: {exc!r}", notify=False)
                raise ExecutorUnavailableError(f"a tensor-parallel rank was lost: {exc}") from exc
            finally:
                self._last_sent = time.monotonic()

    def check_alive(self) -> None:
        if self.lost is not None:
            raise ExecutorUnavailableError(f"a tensor-parallel rank was lost: {self.lost}")

    def close(self) -> None:
        """Tell the ranks to exit, reap the ones started here, leave the group."""
        self._closed.set()
        with self._lock:
            if self.lost is None:
                try:
                    self.group.send(RankShutdown())
                except Exception as exc:  # noqa: BLE001  (closing anyway)
                    # e.g. at interpreter exit, after the step thread's end stopped them
                    log.info("ranks had left before the shutdown", error=repr(exc))
        for process in self.processes:
            try:
                process.wait(timeout=SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.group.close()

    def _keepalive(self) -> None:
        while not self._closed.wait(self.interval_s / 2):
            with self._lock:
                if self.lost is not None or self._closed.is_set():
                    return
                exited = [p.pid for p in self.processes if p.poll() is not None]
                if exited:
                    self._lose(f"rank process(es) {exited} exited")
                    return
                if time.monotonic() - self._last_sent < self.interval_s:
                    continue
                try:
                    self.group.send(RankKeepalive())
                except Exception as exc:  # noqa: BLE001  (every failure loses the group)
                    self._lose(f"keepalive: {exc!r}")
                    return
                self._last_sent = time.monotonic()

    def _lose(self, reason: str, notify: bool = True) -> None:
        self.lost = reason
        log.error("tensor-parallel group lost", reason=reason)
        if notify and self.on_lost is not None:
            self.on_lost(reason)
