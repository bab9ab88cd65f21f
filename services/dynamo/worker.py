"""`kvpager dynamo`: a kvpager engine as an NVIDIA Dynamo worker (token in, token out).

    register_model(Tokens) -> Dynamo's frontend tokenizes and routes (KV-aware) to us
    generate(request, context): to_request -> AsyncEngine.add -> its deltas as Dynamo chunks
    after each step: kvpager's block events -> KvEventPublisher; its load -> metrics

Discovery, request plane and event plane are Dynamo's own settings, read from its usual
environment (DYN_DISCOVERY_BACKEND, DYN_FILE_KV, ETCD_ENDPOINTS, DYN_REQUEST_PLANE, NATS_SERVER,
DYN_EVENT_PLANE). Cancellation (`context.is_stopped()`, or the stream dropped) aborts the request
in the engine at once, freeing its blocks.
"""

import asyncio
import itertools
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from dynamo.llm import (
    KvEventPublisher,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerMetricsPublisher,
    WorkerType,
    register_model,
)
from dynamo.runtime import DistributedRuntime
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.async_kv import AsyncKvMoves
from kvpager.engine.config import EngineConfig
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.dynamo import disagg
from kvpager.services.dynamo.kv_events import DynamoKvEvents
from kvpager.services.dynamo.requests import to_output, to_request

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DynamoOptions:
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    served_model_name: str | None = None  # None: the model as given
    disaggregation_mode: str | None = None  # "prefill", "decode", or None: aggregated


# per disaggregation mode: the OpenAI surface, the role and the peers it needs. A prefill
# worker has no surface; it also sets the legacy ModelType.Prefill bit, as Dynamo's own
# backends do (components/backends/vllm), for frontends that detect prefill by it.
ROLES = {
    None: (ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, None),
    "prefill": (ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]),
    "decode": (ModelType.Chat | ModelType.Completions, WorkerType.Decode, [[WorkerType.Prefill]]),
}


class DynamoWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        kv_events: DynamoKvEvents | None = None,
        mode: str | None = None,
        moves: AsyncKvMoves | None = None,
    ) -> None:
        self.engine = engine
        self.kv_events = kv_events
        self.mode = mode  # "prefill", "decode" or None (aggregated)
        self.moves = moves  # KV moves over NIXL, under a disaggregation mode
        self.metrics: WorkerMetricsPublisher | None = None
        self._ids = itertools.count()
        self._last_used_blocks = -1  # the load last published (a change is published)
        self.engine.scheduler.block_manager.record_kv_events()
        engine.on_publish = self._after_step

    async def generate(self, payload: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's handler: stream one request's chunks until every sample has finished."""
        request_id = f"{context.id()}-{next(self._ids)}"
        engine = self.engine
        request = to_request(
            payload, request_id, self.engine.model_config.eos_token_ids, engine.ready.max_model_len
        )
        if self.mode == "prefill":
            disagg.as_prefill(request)
        elif self.mode == "decode" and self.moves is not None:
            await disagg.import_kv(payload, request, self.moves)
        queue = engine.add(request)
        num_open = request.sampling_params.n
        stopped = asyncio.ensure_future(context.async_killed_or_stopped())
        try:
            while num_open:
                delta = await _next_or_stopped(queue, stopped)
                if delta is None:
                    return  # stopped or killed: aborted below
                num_open -= delta.finish_reason is not None
                if delta.finish_reason is not None:
                    self._log_finished(request_id, request.num_prompt_tokens, delta)
                yield self._chunk(request, delta)
        finally:
            stopped.cancel()
            self._release_unsent_hold(request_id)
            if engine.release(request_id):  # it still ran: stopped, killed or dropped
                self._log_aborted(request_id)

    def _chunk(self, request, delta: SampleDelta) -> dict[str, Any]:
        """The output chunk; a prefill's last one carries its held blocks for the decode side
        (finish_reason "length": Dynamo calls decode only then)."""
        chunk = to_output(delta)
        if self.mode != "prefill" or delta.finish_reason is None or self.moves is None:
            return chunk
        handoff = self.engine.scheduler.take_hold(request.request_id)
        if handoff is not None:
            card = self.moves.card
            chunk["disaggregated_params"] = disagg.prefill_params(
                handoff, card, request.num_prompt_tokens
            )
            log.info("dynamo prefill held", request_id=request.request_id, **_held(handoff))
        return chunk

    def _release_unsent_hold(self, request_id: str) -> None:
        """A prefill whose handoff never left (the stream dropped first): free its blocks."""
        handoff = self.engine.scheduler.take_hold(request_id)
        if handoff is not None:
            self.engine.scheduler.release(handoff.transfer_id)

    def _log_finished(self, request_id: str, num_prompt_tokens: int, delta: SampleDelta) -> None:
        log.info(
            "dynamo request finished",
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            finish_reason=delta.finish_reason,
            num_used_blocks=self.engine.scheduler.block_manager.num_used_blocks,
            kv_transfer_blocks=self.engine.scheduler.kv_stats.num_blocks,
        )

    def _log_aborted(self, request_id: str) -> None:
        scheduler = self.engine.scheduler
        log.info(
            "dynamo request aborted",
            request_id=request_id,
            num_running=len(scheduler.running),
            num_used_blocks=scheduler.block_manager.num_used_blocks,
        )

    def _after_step(self) -> None:
        manager = self.engine.scheduler.block_manager
        events = manager.take_kv_events()
        if self.kv_events is not None and events:
            self.kv_events.publish(events)
        num_used_blocks = manager.num_used_blocks
        if self.metrics is not None and num_used_blocks != self._last_used_blocks:
            self.metrics.publish(None, None, num_used_blocks)
            self._last_used_blocks = num_used_blocks


async def _next_or_stopped(
    queue: asyncio.Queue[SampleDelta], stopped: asyncio.Future
) -> SampleDelta | None:
    """The next delta, or None once the request is stopped or killed."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    await asyncio.wait((getter, stopped), return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


def _held(handoff) -> dict[str, Any]:
    num_blocks = sum(len(table) for table in handoff.block_tables)
    return {"transfer_id": handoff.transfer_id, "num_blocks": num_blocks}


def runtime_config(engine: AsyncEngine) -> ModelRuntimeConfig:
    config = ModelRuntimeConfig()
    config.context_length = engine.ready.max_model_len
    config.total_kv_blocks = engine.ready.num_blocks
    config.max_num_seqs = engine.ready.max_num_seqs
    config.max_num_batched_tokens = engine.config.max_num_batched_tokens
    return config


async def serve(
    path: Path, model: str, config: EngineConfig, options: DynamoOptions, check: bool = False
) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop,
        os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
    )
    endpoint = runtime.endpoint(f"{options.namespace}.{options.component}.{options.endpoint}")
    engine = AsyncEngine(path, config, name="dynamo", check_invariants=check)
    publisher = KvEventPublisher(endpoint, kv_block_size=engine.block_size)
    pool = engine.scheduler.block_manager.pool
    mode = options.disaggregation_mode
    moves = None if mode is None else disagg.kv_moves(engine, f"kvpager-{mode}-{os.getpid()}")
    worker = DynamoWorker(engine, DynamoKvEvents(publisher, pool, engine.block_size), mode, moves)
    worker.metrics = WorkerMetricsPublisher()
    await worker.metrics.create_endpoint(endpoint)
    engine_task = loop.create_task(engine.run())
    engine_task.add_done_callback(lambda task: _shutdown_if_failed(task, runtime))
    if moves is not None:
        moves.start()
    model_type, worker_type, needs = ROLES[mode]
    await register_model(
        ModelInput.Tokens,
        model_type,
        endpoint,
        str(path),
        options.served_model_name or model,
        worker_type=worker_type,
        needs=needs,
        kv_cache_block_size=engine.block_size,
        runtime_config=runtime_config(engine),
    )
    log.info("dynamo worker ready", model=model, block_size=engine.block_size, mode=mode)
    for sig in (signal.SIGTERM, signal.SIGINT):  # Dynamo's graceful shutdown: streams finish
        loop.add_signal_handler(sig, runtime.shutdown)
    try:
        await endpoint.serve_endpoint(worker.generate)
    finally:
        engine.stop()  # after the last stream (or after the engine failed)
        await engine_task  # its exception, if it failed, ends the process with it
        engine.close()
        if moves is not None:
            moves.close()
        log.info("dynamo worker stopped")


def _shutdown_if_failed(task: asyncio.Task, runtime: DistributedRuntime) -> None:
    """A failed engine ends serving (its requests have failed): Dynamo routes elsewhere."""
    if not task.cancelled() and task.exception() is not None:
        runtime.shutdown()
