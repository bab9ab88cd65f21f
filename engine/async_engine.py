"""AsyncEngine: the engine core and an in-process executor, driven on the caller's asyncio loop
while requests come and go, each with a queue of its SampleDeltas.

The third door onto the same core, for front doors that own their loop (the Dynamo worker,
services/dynamo/): the executor is built as the offline `LLM` builds it, the step pipeline is
`EngineCore.run_step()` driven as the scheduler service drives it (idle until work arrives),
and outputs leave as SampleDeltas, token ids only (the caller's frontend detokenizes).

    add(request) -> queue   run() steps while there is work   abort(request_id) frees at once
"""

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog
from kvpager.engine.config import EngineConfig
from kvpager.engine.core import EngineCore, build_scheduler
from kvpager.engine.memory import resolve_device
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.request import Request
from kvpager.engine.worker.step_runner import InProcessExecutor
from kvpager.engine.worker.tensor_parallel import build_executor
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.tokenizer import SampleDelta

log = structlog.get_logger(__name__)
IDLE_WAIT_S = 0.01  # a step that computed nothing: wait this long (or for new work) first


class AsyncEngine:
    def __init__(
        self, path: Path, config: EngineConfig, name: str = "async", check_invariants: bool = False
    ) -> None:
        self.config = config
        self.model_config = ModelConfig.from_path(path)
        executor_config = config.executor_config(path, self.model_config)
        self.runner = InProcessExecutor(
            lambda: build_executor(executor_config, self.model_config),
            resolve_device(executor_config.device),
        )
        self.ready = self.runner.executor.ready(name, str(path))
        self.scheduler = build_scheduler(config, self.ready)
        self.core = EngineCore(
            self.scheduler,
            self.runner,
            self._on_deltas,
            config.plan_ahead,
            check_invariants=check_invariants,
            plan_ahead_with_room=False,  # served: a new arrival joins the next step
        )
        self.on_publish: Callable[[], None] = lambda: None  # after each batch of deltas
        self._streams: dict[str, asyncio.Queue[SampleDelta]] = {}
        self._work = asyncio.Event()
        self._stopped = False

    @property
    def block_size(self) -> int:
        return self.ready.block_size

    def add(self, request: Request) -> asyncio.Queue[SampleDelta]:
        """Queue a request (or raise a typed error: nothing is queued then); its deltas come
        on the queue returned, the last one of each sample with a finish_reason."""
        if request.request_id in self._streams:
            raise ValueError(f"request {request.request_id!r} is already running")
        self.core.add(request)
        queue: asyncio.Queue[SampleDelta] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._work.set()
        return queue

    def release(self, request_id: str) -> bool:
        """The caller stops reading: abort whatever still runs (its blocks are freed now).
        True if something still ran."""
        self._streams.pop(request_id, None)
        aborted = self.core.finish_early(request_id, "abort")
        if aborted:
            self._work.set()  # the executor drops its rows at the next step
        return aborted

    async def run(self) -> None:
        """Step while there is work, idle until there is; a bug fails every request (its
        blocks freed) and is raised: the caller's process should end, as no state is trusted."""
        core = self.core
        try:
            while not self._stopped:
                if not await core.run_step():
                    await self._wait_for_work()
                elif core.is_spinning:
                    await self._idle_briefly()
        except Exception:
            log.exception("engine loop failed: failing every request")
            core.fail_open(ErrorInfo("internal_error", "the engine failed; see its log"))
            core.abandon()
            await core.publish()
            raise

    def wake(self) -> None:
        """Work came from elsewhere (a KV pull ended): step again."""
        self._work.set()

    def stop(self) -> None:
        self._stopped = True
        self._work.set()

    def close(self) -> None:
        self.runner.close()

    async def _wait_for_work(self) -> None:
        self._work.clear()  # before the publish: work that comes during it is not missed
        await self.core.publish()  # the last step's final deltas
        await self._work.wait()

    async def _idle_briefly(self) -> None:
        self._work.clear()
        try:
            await asyncio.wait_for(self._work.wait(), timeout=IDLE_WAIT_S)
        except TimeoutError:
            pass

    async def _on_deltas(self, deltas: list[SampleDelta], step_id: int) -> None:
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:  # else released: its reader has gone
                queue.put_nowait(delta)
        self.on_publish()
