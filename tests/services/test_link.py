"""The scheduler's ExecutorLink over a real nats-server: several steps on their way at once."""

import asyncio

import msgspec
import nats
from kvpager.schemas.executor import RunStep, ScheduledStep, SchedulerMessage
from kvpager.schemas.scheduler import StepDone, StepOutput
from kvpager.services.connection import flush_sent
from kvpager.services.scheduler.link import ExecutorLink
from kvpager.services.subjects import Subjects
from kvpager.services.wire import pack


async def test_answers_that_come_before_they_are_awaited_are_kept(nats_server):
    subjects = Subjects("linktest", "default")
    scheduler_nc = await nats.connect(nats_server.url)
    executor_nc = await nats.connect(nats_server.url)
    decoder = msgspec.msgpack.Decoder(SchedulerMessage)

    async def execute(msg) -> None:  # answers at once, before the scheduler awaits anything
        step = decoder.decode(msg.data)
        assert isinstance(step, RunStep)
        output = StepOutput(step.step.step_id, ["r"], [step.step.step_id * 10])
        await executor_nc.publish(subjects.scheduler_outputs, pack(StepDone(output, 0.0, 0.0)))

    await executor_nc.subscribe(subjects.executor_steps, cb=execute)
    await flush_sent(executor_nc)  # the server has the subscription
    lost = []
    link = ExecutorLink(scheduler_nc, subjects, 64, step_timeout_s=5.0, lose_executor=lost.append)
    await link.start()
    try:
        for step_id in (1, 2):
            await link.submit(ScheduledStep(step_id=step_id))
        await asyncio.sleep(0.2)  # both answers are in before the first is awaited
        first, second = await link.result(1), await link.result(2)
        assert first.output.sampled_token_ids == [10] and second.output.sampled_token_ids == [20]
        await link.submit(ScheduledStep(step_id=3))
        link.cancel()  # e.g. the executor was lost: an abandoned step answers None
        assert await link.result(3) is None
        assert await link.result(4) is None  # never sent
        assert lost == []  # nothing timed out
    finally:
        await scheduler_nc.close()
        await executor_nc.close()
