"""The scheduler's end of the step exchange: steps out, exactly one answer back for each.

The engine core's StepRunner over NATS (engine/worker/step_runner.py has the in-process one).
"""

import asyncio
from collections.abc import Callable

import msgspec
import structlog
from kvpager.schemas.executor import RunStep, ScheduledStep, StepPiece, StepRequests
from kvpager.schemas.kv_transfer import KvPulled, KvSent
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import ExecutorMessage, StepDone, StepFailed, StepPart
from kvpager.services.fit import join_done, split_step
from kvpager.services.pieces import split
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack, payload_budget, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

_decoder = msgspec.msgpack.Decoder(ExecutorMessage)


class ExecutorLink:
    """Sends ScheduledSteps (long token lists ahead as StepPieces, and leading new requests as
    StepRequests when the step would not fit in one message) and awaits each answer (a StepDone
    after its StepParts, if any).

    Several steps may be on their way at once (the scheduler plans ahead); each has its own
    future from the moment it is sent, so an answer that comes before anyone awaits it is kept.
    An answer to no pending step is dropped: a late one to a step the scheduler gave up on, or
    a duplicate.
    """

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        piece_tokens: int,
        step_timeout_s: float,
        lose_executor: Callable[[ErrorInfo], None],
        on_kv: Callable[[KvPulled | KvSent], None] = lambda message: None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.piece_tokens = piece_tokens
        self.step_timeout_s = step_timeout_s
        self._lose_executor = lose_executor  # a step not answered in time
        self._on_kv = on_kv  # KV transfers' ends (engine/sched/kv_moves.py)
        self._pending: dict[int, asyncio.Future] = {}  # by step id
        self._parts: dict[int, list[StepPart]] = {}  # by step id, until its StepDone

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.scheduler_outputs, cb=self._on_output)

    @property
    def _piece_tokens(self) -> int:
        """Ids per StepPiece: `piece_tokens`, fewer if they could not fit the server's limit
        (a token id packs into at most 5 bytes)."""
        return max(1, min(self.piece_tokens, payload_budget(self.nc) // 6))

    async def submit(self, step: ScheduledStep) -> None:
        subject, piece_tokens = self.subjects.executor_steps, self._piece_tokens
        if sum(len(new.token_ids) for new in step.new_requests) > piece_tokens:
            step = await self._send_pieces(step, piece_tokens)
        ahead, step = split_step(step, payload_budget(self.nc))
        self._pending[step.step_id] = asyncio.get_running_loop().create_future()
        for new_requests in ahead:
            await self.nc.publish(subject, pack(StepRequests(new_requests)))
        await self.nc.publish(subject, pack(RunStep(step)))

    async def _send_pieces(self, step: ScheduledStep, piece_tokens: int) -> ScheduledStep:
        """The step's long token lists ahead in StepPieces; the RunStep keeps at most
        `piece_tokens` ids in all (services/pieces.py has the rule, shared with tokenizers)."""
        room, new_requests = piece_tokens, []
        for new in step.new_requests:
            pieces, tail = split(new.token_ids, piece_tokens, keep=room)
            room -= len(tail)
            for piece in pieces:
                await self.nc.publish(
                    self.subjects.executor_steps, pack(StepPiece(new.seq_id, piece))
                )
            new_requests.append(msgspec.structs.replace(new, token_ids=tail))
        return msgspec.structs.replace(step, new_requests=new_requests)

    async def result(self, step_id: int) -> StepDone | ErrorInfo | None:
        """The executor's answer to a sent step: its output, an ErrorInfo if it failed, None
        after `cancel()` or when it timed out (the executor is then lost)."""
        answer = await self._answer(step_id)
        if isinstance(answer, StepFailed):
            message = f"the executor failed step {answer.step_id}: {answer.message}"
            return ErrorInfo(answer.error_type, message)
        return answer

    async def _answer(self, step_id: int) -> StepDone | StepFailed | None:
        pending = self._pending.get(step_id)
        if pending is None:  # cancelled while it was being sent
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.step_timeout_s)
        except TimeoutError:
            message = f"the executor did not answer step {step_id} in {self.step_timeout_s} s"
            self._lose_executor(ErrorInfo("executor_unavailable", message))
            return None
        finally:
            self._pending.pop(step_id, None)
            self._parts.pop(step_id, None)

    def cancel(self) -> None:
        """Every awaited or not yet awaited answer is None: the steps are abandoned."""
        for pending in self._pending.values():
            if not pending.done():
                pending.set_result(None)
        self._pending.clear()
        self._parts.clear()

    async def _on_output(self, msg: Msg) -> None:
        message = unpack(_decoder, msg.data, msg.subject)
        if message is None:
            return  # the step it answered times out
        if isinstance(message, KvPulled | KvSent):
            self._on_kv(message)
            return
        step_id = message.output.step_id if isinstance(message, StepDone) else message.step_id
        pending = self._pending.get(step_id)
        if pending is None or pending.done():
            log.error("answer to no pending step: dropped", step_id=step_id)
            return
        if isinstance(message, StepPart):  # the rest of the answer follows
            self._parts.setdefault(step_id, []).append(message)
            return
        if isinstance(message, StepDone):
            message = self._joined(step_id, message)
        pending.set_result(message)

    def _joined(self, step_id: int, done: StepDone) -> StepDone | StepFailed:
        """The StepDone with its parts; a StepFailed if they do not join (parts lost)."""
        try:
            return join_done(self._parts.pop(step_id, []), done)
        except ValueError as exc:
            return StepFailed(step_id, f"the step's output parts do not join: {exc}")
