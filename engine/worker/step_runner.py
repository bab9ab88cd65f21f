"""The engine core's StepRunner (declared in engine/core.py) in this process: submit a step,
later await its answer.

Two implementations of that protocol: `InProcessExecutor` here (the Executor on a worker
thread of this process: the offline `LLM`, and the executor service, which feeds it the
steps it gets over NATS) and the scheduler service's link over NATS
(services/scheduler/link.py). Several steps may be submitted before the first answer is
awaited; answers come in submission order.
"""

import asyncio
import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from kvpager.engine.worker.executor import Executor
from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import StepDone


def step_thread(device: torch.device | None) -> ThreadPoolExecutor:
    """The one thread every step runs on (CUDA's current device is per thread: set it once).
    A bare "cuda" names no index, and set_device refuses it: the thread keeps the default."""

    def init() -> None:
        if device is not None and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpager-step", initializer=init)


class InProcessExecutor:
    """An Executor built and run on one worker thread, so steps overlap the caller's work.

    The thread that loads the model also runs every step (on CPU, first-touch memory and
    oneDNN's packed weights stay local to the thread that loaded and packed them, so steps on
    another thread run slower).
    """

    def __init__(self, build: Callable[[], Executor], device: torch.device | None = None) -> None:
        self._worker = step_thread(device)
        context = contextvars.copy_context()  # the build's log lines carry the caller's context
        self.executor: Executor = self._worker.submit(context.run, build).result()
        self._pending: dict[int, Future] = {}
        self._last_output_at: float | None = None
        self._closed = False

    async def submit(self, step: ScheduledStep) -> None:
        # the step's log lines (a kernel built on first use, a path switched off) carry the
        # caller's context, as the build's do: a service's name, a request's id
        context = contextvars.copy_context()
        self._pending[step.step_id] = self._worker.submit(context.run, self._timed, step)

    async def result(self, step_id: int) -> StepDone | ErrorInfo | None:
        pending = self._pending.pop(step_id, None)
        if pending is None:
            return None
        return await asyncio.wrap_future(pending)

    def cancel(self) -> None:
        for pending in self._pending.values():
            pending.cancel()
        self._pending.clear()

    async def run(self, step: ScheduledStep) -> StepDone:
        """Submit one step and await its answer (it raises what the step raised)."""
        await self.submit(step)
        return await asyncio.wrap_future(self._pending.pop(step.step_id))

    def close(self) -> None:
        """Idempotent. Tensor-parallel ranks are told to stop before the step thread (which
        started them, and whose end they would die of) goes."""
        if not self._closed:
            self._closed = True
            self.executor.close()
            self._worker.shutdown(wait=True)

    def _timed(self, step: ScheduledStep) -> StepDone:
        started = time.monotonic()
        wait_s = started - self._last_output_at if self._last_output_at else 0.0
        output = self.executor.execute(step)
        self._last_output_at = time.monotonic()
        return StepDone(output, self._last_output_at - started, wait_s)
