"""An asyncio loop on a thread of its own: the offline `LLM`'s blocking calls run the engine
core there, so they work the same from plain scripts and from code already inside a loop."""

import asyncio
import atexit
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvpager.kernels.openmp import serial_here

T = TypeVar("T")
EXIT_WAIT_S = 30.0
_stopping: set[threading.Thread] = set()  # loop threads finishing a `stop_after`


@atexit.register
def _finish_stopping() -> None:
    """The interpreter kills daemon threads at exit: one mid-close (a runner's executor,
    native threads inside) aborts the process ("terminate called without an active
    exception"). Let every `stop_after` finish first."""
    for thread in list(_stopping):
        thread.join(EXIT_WAIT_S)


class LoopThread:
    def __init__(self, name: str = "kvpager-engine") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        serial_here()  # the engine core's torch ops stay off OpenMP (kernels/openmp.py)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # Ctrl-C while waiting: stop the coroutine too
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)

    def stop_after(self, work: Callable[[], None]) -> None:
        """Run `work` on the loop's thread, then end the loop. Returns at once, joins nothing
        and takes no lock, so a garbage collector's finalizer may call it on any thread; the
        interpreter's exit waits for it."""

        def work_then_stop() -> None:
            try:
                work()
            finally:
                self.loop.stop()

        try:
            self.loop.call_soon_threadsafe(work_then_stop)
        except RuntimeError:  # the loop is closed: nothing is left to end
            return
        _stopping.add(self._thread)
