"""The executor's compiles: in a thread with a large stack, waited for with a time budget.

The executor needs the compiled matcher in its own process (it fills masks every step), so
it cannot hand the compile to another process as the front doors do. llguidance recurses
over a grammar's rules: on a thread of `STACK_BYTES` a chain far past the front doors' size
limits still fits, and the step waits at most `timeout_s`. A compile past it is abandoned
(its thread left to finish alone, a new one started) and its request fails by itself.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from kvpager.kernels.openmp import serial_here
from kvpager.schemas.errors import InvalidRequestError

STACK_BYTES = 256 << 20  # reserved address space; pages are only touched when used
T = TypeVar("T")


class CompileThread:
    """One daemon thread with a large stack running compiles one at a time."""

    def __init__(self, timeout_s: float, stack_bytes: int = STACK_BYTES) -> None:
        self.timeout_s = timeout_s
        self.stack_bytes = stack_bytes
        self.num_abandoned = 0
        self._jobs: queue.SimpleQueue | None = None

    def run(self, fn: Callable[[], T], param: str) -> T:
        """`fn()`'s result, or its exception; InvalidRequestError naming `param` past the
        time budget."""
        future: Future = Future()
        jobs = self._jobs or self._start()
        jobs.put((fn, future))
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            self._jobs = None  # the stuck thread keeps its queue; the next call gets a new one
            self.num_abandoned += 1
            message = f"{param}: the grammar took longer than {self.timeout_s:g} s to compile"
            raise InvalidRequestError(message, param=param) from None

    def _start(self) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(self.stack_bytes)
        try:
            thread = threading.Thread(target=_serve, args=(jobs,), name="grammar-compile")
            thread.daemon = True
            thread.start()
        finally:
            threading.stack_size(previous)
        self._jobs = jobs
        return jobs


def _serve(jobs: queue.SimpleQueue) -> None:
    serial_here()  # beside the steps: no OpenMP team of its own (kernels/openmp.py)
    while True:
        fn, future = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller, which raises it
            future.set_exception(exc)
