"""The executor service over a real nats-server, with this test as its scheduler: steps naming
blocks outside the cache, out of order or undecodable are answered with a typed StepFailed (or
dropped), the process keeps running and keeps its state, and the request it was running goes on
with the tokens an undisturbed run samples. A stopping executor stays while its scheduler
still has requests, however long no step comes."""

import asyncio
import signal

import msgspec
import nats
from kvpager.engine import LLM
from kvpager.schemas.executor import Attached, CachedRequest, NewRequest, RunStep, ScheduledStep
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import (
    ExecutorMessage,
    ExecutorReady,
    SchedulerInfo,
    StepDone,
    StepFailed,
)
from kvpager.services.connection import flush_sent
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack

from tests.services.conftest import start_services

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 7, 9]  # 12 tokens: one block of 16


class FakeScheduler:
    """Answers the executor's attach and liveness pings as a scheduler does; collects answers."""

    def __init__(self, nc, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.ready: ExecutorReady | None = None
        self.answers: asyncio.Queue = asyncio.Queue()
        self.num_unfinished = 0  # what the info answers
        self._decoder = msgspec.msgpack.Decoder(ExecutorMessage)

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.scheduler_attach, cb=self._attach)
        await self.nc.subscribe(self.subjects.scheduler_info, cb=self._info)
        await self.nc.subscribe(self.subjects.scheduler_outputs, cb=self._output)
        await flush_sent(self.nc)

    async def _attach(self, msg) -> None:
        self.ready = msgspec.msgpack.decode(msg.data, type=ExecutorReady)
        await msg.respond(pack(Attached("fake-scheduler")))

    async def _info(self, msg) -> None:
        executor_id = self.ready.executor_id if self.ready else ""
        info = SchedulerInfo(
            True, "m", 512, 384, "fake-scheduler", executor_id, num_unfinished=self.num_unfinished
        )
        await msg.respond(msgspec.msgpack.encode(info))

    async def _output(self, msg) -> None:
        await self.answers.put(self._decoder.decode(msg.data))

    async def step(self, step: ScheduledStep) -> StepDone | StepFailed:
        await self.nc.publish(self.subjects.executor_steps, pack(RunStep(step)))
        return await asyncio.wait_for(self.answers.get(), 30.0)


async def _executor_for_this_test(nats_server, model, tmp_path, prefix: str):
    """An executor service attached to this test as its scheduler: (nc, scheduler, services)."""
    nc = await nats.connect(nats_server.url)
    scheduler = FakeScheduler(nc, Subjects(prefix, "default"))
    await scheduler.start()
    services = start_services(nats_server.url, model, tmp_path, prefix=prefix, names=("executor",))
    try:
        while scheduler.ready is None:
            assert services.processes["executor"].poll() is None, services.log_lines("executor")
            await asyncio.sleep(0.1)
    except BaseException:
        services.stop()
        await nc.close()
        raise
    return nc, scheduler, services


def _decode(step_id: int, computed: int, **changes) -> ScheduledStep:
    cached = CachedRequest("a", computed, **changes)
    return ScheduledStep(step_id, cached_requests=[cached], num_scheduled_tokens={"a": 1})


async def test_bad_steps_get_typed_errors_and_the_executor_keeps_its_state(
    nats_server, tiny_llama, tmp_path
):
    offline = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=48)
    reference = offline.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    offline.close()
    nc, scheduler, services = await _executor_for_this_test(
        nats_server, tiny_llama, tmp_path, "steps"
    )
    subjects = scheduler.subjects
    try:
        num_blocks = scheduler.ready.num_blocks
        new = NewRequest("a", PROMPT, len(PROMPT), GREEDY, [2], 0)
        first = await scheduler.step(
            ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"a": len(PROMPT)})
        )
        assert isinstance(first, StepDone) and first.output.sampled_token_ids == reference[:1]
        bad = [
            _decode(2, 12, new_block_ids=[2**31 - 1], replace_from=1),  # a SIGSEGV before
            _decode(3, 12, new_block_ids=[num_blocks], replace_from=0),  # another's K/V
            ScheduledStep(4, blocks_to_copy=[(2, num_blocks + 3)]),
            _decode(9, 12),  # out of order: refused, and 5 is still the one expected
        ]
        for step in bad:
            answer = await scheduler.step(step)
            assert isinstance(answer, StepFailed) and answer.error_type == "invalid_step", answer
        # undecodable: dropped with a log line, nothing answered
        await nc.publish(subjects.executor_steps, b"\x93\xa4step\x01")
        # a refused step leaves the request as it was: it goes on
        second = await scheduler.step(_decode(5, 12))
        assert isinstance(second, StepDone), second
        assert second.output.sampled_token_ids == reference[1:2]
        assert services.processes["executor"].poll() is None
        logs = "\n".join(services.log_lines("executor"))
        assert "undecodable message" in logs
    finally:
        services.stop()
        await nc.close()


async def test_a_stopping_executor_stays_while_its_scheduler_has_requests(
    nats_server, tiny_llama, tmp_path
):
    """`kvpager serve` signals a scheduler and its executor at once; on a loaded host the
    executor may handle it first, and no step come for a while. It must not go (its
    scheduler's streams would fail) until the scheduler has no request left."""
    nc, scheduler, services = await _executor_for_this_test(
        nats_server, tiny_llama, tmp_path, "stopping"
    )
    executor = services.processes["executor"]
    try:
        new = NewRequest("a", PROMPT, len(PROMPT), GREEDY, [2], 0)
        first = await scheduler.step(
            ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"a": len(PROMPT)})
        )
        assert isinstance(first, StepDone)
        scheduler.num_unfinished = 1
        executor.send_signal(signal.SIGTERM)
        await asyncio.sleep(2.0)  # four times the idle time after which it would go
        assert executor.poll() is None, services.log_lines("executor")
        assert isinstance(await scheduler.step(_decode(2, 12)), StepDone)
        scheduler.num_unfinished = 0
        assert await asyncio.to_thread(executor.wait, 10) == 0
    finally:
        services.stop()
        await nc.close()


async def test_steps_sent_ahead_are_answered_in_order(nats_server, tiny_llama, tmp_path):
    """A scheduler plans a step ahead: the next step comes before the last one's answer. The
    executor hands it on at once and answers both in order, with the tokens of an undisturbed
    run; a refused step sent behind them is answered after them."""
    offline = LLM(str(tiny_llama), dtype="float32", block_size=16, num_blocks=48)
    reference = offline.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    offline.close()
    nc, scheduler, services = await _executor_for_this_test(
        nats_server, tiny_llama, tmp_path, "ahead"
    )
    try:
        new = NewRequest("a", PROMPT, len(PROMPT), GREEDY, [2], 0)
        steps = [
            ScheduledStep(1, new_requests=[new], num_scheduled_tokens={"a": len(PROMPT)}),
            _decode(2, 12),
            _decode(3, 13),
            _decode(7, 14),  # out of order: refused after the answers before it
        ]
        for step in steps:
            await nc.publish(scheduler.subjects.executor_steps, pack(RunStep(step)))
        answers = [await asyncio.wait_for(scheduler.answers.get(), 30.0) for _ in steps]
        assert [a.output.step_id for a in answers[:3]] == [1, 2, 3], answers
        assert [a.output.sampled_token_ids[0] for a in answers[:3]] == reference[:3]
        assert isinstance(answers[3], StepFailed) and answers[3].step_id == 7, answers[3]
        assert services.processes["executor"].poll() is None
    finally:
        services.stop()
        await nc.close()
