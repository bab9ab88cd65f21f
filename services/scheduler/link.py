"""The scheduler's end of the step exchange: a step out, exactly one answer back."""

import asyncio

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas.executor import RunStep, ScheduledStep, StepPiece
from schemas.scheduler import ExecutorMessage, StepDone, StepFailed
from services.subjects import Subjects
from services.wire import pack

log = structlog.get_logger(__name__)

_decoder = msgspec.msgpack.Decoder(ExecutorMessage)


class ExecutorLink:
    """Sends ScheduledSteps (long token lists ahead as StepPieces) and awaits each answer.

    An answer whose `step_id` is not the awaited one is dropped: a late answer to a step the
    scheduler gave up on, or a duplicate.
    """

    def __init__(self, nc: NATS, subjects: Subjects, piece_tokens: int) -> None:
        self.nc = nc
        self.subjects = subjects
        self.piece_tokens = piece_tokens
        self._pending: asyncio.Future | None = None
        self._pending_step_id = 0

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.scheduler_outputs, cb=self._on_output)

    async def send(self, step: ScheduledStep) -> None:
        size, subject = self.piece_tokens, self.subjects.executor_steps
        if sum(len(new.token_ids) for new in step.new_requests) > size:
            new_requests = []
            for new in step.new_requests:
                for start in range(0, len(new.token_ids), size):
                    piece = StepPiece(new.req_id, new.token_ids[start : start + size])
                    await self.nc.publish(subject, pack(piece))
                new_requests.append(msgspec.structs.replace(new, token_ids=[]))
            step = msgspec.structs.replace(step, new_requests=new_requests)
        await self.nc.publish(subject, pack(RunStep(step)))

    async def answer(self, step_id: int, timeout_s: float) -> StepDone | StepFailed | None:
        """The executor's answer to `step_id`; None on a timeout or after `cancel()`."""
        self._pending = asyncio.get_running_loop().create_future()
        self._pending_step_id = step_id
        try:
            return await asyncio.wait_for(self._pending, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self._pending = None

    def cancel(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(None)

    async def _on_output(self, msg: Msg) -> None:
        message = _decoder.decode(msg.data)
        step_id = message.output.step_id if isinstance(message, StepDone) else message.step_id
        pending = self._pending
        if pending is None or pending.done() or step_id != self._pending_step_id:
            log.error(
                "step answer out of order: dropped",
                step_id=step_id,
                expected=self._pending_step_id if pending else None,
            )
            return
        pending.set_result(message)
