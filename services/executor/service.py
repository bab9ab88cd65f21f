"""Executor service: engine.executor.Executor fed ScheduledSteps over NATS.

It announces its capacity until a scheduler answers, then runs each step it receives, in
order, and returns the sampled tokens with its own timings. All tensors stay here; the steps
carry ids only.
"""

import asyncio
import time
import uuid

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from engine.config import ModelConfig
from engine.executor import Executor, ExecutorConfig
from schemas.executor import Attached, RunStep, ScheduledStep, SchedulerMessage, StepPiece
from schemas.scheduler import ExecutorReady, StepDone, StepFailed
from services.settings import Settings
from services.subjects import Subjects
from services.wire import pack

log = structlog.get_logger(__name__)

ANNOUNCE_INTERVAL_S = 0.2
IDLE_BEFORE_EXIT_S = 0.5
_decoder = msgspec.msgpack.Decoder(SchedulerMessage)


def load_executor(settings: Settings) -> Executor:
    path = settings.model_path()
    model_config = ModelConfig.from_path(path)
    config = ExecutorConfig(
        model_path=path,
        dtype=settings.dtype,
        device=settings.device,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        kv_cache_memory=settings.kv_cache_memory,
        swap_space=settings.swap_space,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.resolve_max_model_len(model_config),
        attention_backend=settings.attention_backend,
        seed=settings.seed,
    )
    return Executor(config, model_config)


class ExecutorService:
    def __init__(self, nc: NATS, settings: Settings, executor: Executor) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.executor = executor
        self.executor_id = uuid.uuid4().hex[:12]
        self._pieces: dict[str, list[int]] = {}
        self._last_step_id: int | None = None
        self._last_output_at: float | None = None
        self._announce_task: asyncio.Task | None = None
        self._last_activity = 0.0

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.executor_steps, cb=self._on_message)
        self._announce_task = asyncio.get_running_loop().create_task(self._announce())

    def ready_message(self) -> ExecutorReady:
        executor, config = self.executor, self.executor.config
        return ExecutorReady(
            executor_id=self.executor_id,
            num_blocks=executor.num_blocks,
            num_cpu_blocks=executor.num_cpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            eos_token_ids=list(executor.model_config.eos_token_ids),
            vocab_size=executor.model_config.vocab_size,
            model=self.settings.model,
        )

    async def _announce(self) -> None:
        """Ask to attach until a scheduler answers (it may start before or after us)."""
        payload = pack(self.ready_message())
        while True:
            try:
                reply = await self.nc.request(self.subjects.scheduler_attach, payload, timeout=2)
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(ANNOUNCE_INTERVAL_S)
        attached = msgspec.msgpack.decode(reply.data, type=Attached)
        log.info(
            "attached to scheduler",
            scheduler=attached.scheduler_id,
            executor=self.executor_id,
            num_blocks=self.executor.num_blocks,
        )

    async def _on_message(self, msg: Msg) -> None:
        received_at = self._last_activity = time.monotonic()
        message = _decoder.decode(msg.data)
        if isinstance(message, StepPiece):
            self._pieces.setdefault(message.req_id, []).extend(message.token_ids)
        elif isinstance(message, RunStep):
            await self._run_step(message.step, received_at)

    async def _run_step(self, step: ScheduledStep, received_at: float) -> None:
        wait_s = received_at - self._last_output_at if self._last_output_at else 0.0
        expected = None if self._last_step_id is None else self._last_step_id + 1
        self._last_step_id = step.step_id
        if expected is not None and step.step_id != expected:
            await self._fail(step.step_id, f"got step {step.step_id}, expected {expected}")
            return
        try:
            output = self.executor.execute(self._with_pieces(step))
        except Exception as exc:  # a bug: answer so the scheduler fails the requests, not hangs
            log.exception("step failed", step_id=step.step_id)
            await self._fail(step.step_id, repr(exc))
            return
        execute_s = time.monotonic() - received_at
        await self.nc.publish(
            self.subjects.scheduler_outputs, pack(StepDone(output, execute_s, wait_s))
        )
        self._last_output_at = self._last_activity = time.monotonic()

    def _with_pieces(self, step: ScheduledStep) -> ScheduledStep:
        """Put the token ids sent ahead as StepPieces back in front of their NewRequests."""
        if not self._pieces:
            return step
        new_requests = [
            msgspec.structs.replace(new, token_ids=self._pieces.pop(new.req_id) + new.token_ids)
            if new.req_id in self._pieces
            else new
            for new in step.new_requests
        ]
        return msgspec.structs.replace(step, new_requests=new_requests)

    async def _fail(self, step_id: int, message: str) -> None:
        log.error("step failed", step_id=step_id, message=message)
        await self.nc.publish(self.subjects.scheduler_outputs, pack(StepFailed(step_id, message)))
        self._last_output_at = time.monotonic()

    async def stop(self) -> None:
        """Keep serving while steps still come (the scheduler finishing), then stop."""
        if self._announce_task is not None:
            self._announce_task.cancel()
        deadline = time.monotonic() + self.settings.drain_timeout + 5.0
        while time.monotonic() < deadline:
            if time.monotonic() - self._last_activity > IDLE_BEFORE_EXIT_S:
                return
            await asyncio.sleep(0.1)
