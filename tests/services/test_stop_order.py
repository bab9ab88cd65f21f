"""Stopping a scheduler before the rest: while it finishes its streams it still answers its
info (the executor's and tokenizers' liveness ping), counting the requests it has left, so
an executor signalled at the same moment stays until they end."""

import asyncio
import signal

import msgspec
import nats
from kvpager.schemas.scheduler import SchedulerInfo
from kvpager.services.client import Client
from kvpager.services.subjects import Subjects

from tests.services.conftest import start_services, stop_and_check

PREFIX = "stoporder"
NUM_TOKENS = 700  # with its prompt, under the 48 blocks of 16 the services have


async def _info(nc, subject: str) -> SchedulerInfo:
    reply = await nc.request(subject, b"", timeout=5.0)
    return msgspec.msgpack.decode(reply.data, type=SchedulerInfo)


async def test_a_closing_scheduler_answers_its_info_with_the_requests_left(
    nats_server, tiny_llama, tmp_path
):
    services = await asyncio.to_thread(
        start_services,
        nats_server.url,
        tiny_llama,
        tmp_path,
        prefix=PREFIX,
        KVPAGER_DRAIN_TIMEOUT="60",
    )
    client = await Client.connect(services.url, PREFIX)
    nc = await nats.connect(services.url)
    subject = Subjects(PREFIX, "default").scheduler_info
    try:
        assert (await _info(nc, subject)).num_unfinished == 0
        fields = dict(prompt="Once upon a time", max_tokens=NUM_TOKENS, ignore_eos=True)
        stream = client.generate(**fields)
        events = [await anext(stream)]
        services.processes["scheduler"].send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)  # the signal handled: the scheduler is closing
        info = await _info(nc, subject)
        assert info.executor_attached and info.num_unfinished == 1, info
        events += [event async for event in stream]
        assert events[-1].finish_reason == "length" and events[-1].error is None, events[-1]
        assert sum(len(e.token_ids) for e in events) == NUM_TOKENS
        assert services.processes["scheduler"].wait(timeout=30) == 0
    finally:
        await nc.close()
        await client.close()
        stop_and_check(services)
