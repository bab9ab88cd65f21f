"""A tokenizer's StreamWatch over a real nats-server: scheduler answers that change what a
stream's instance is doing, and streams that move while the ping is out."""

import msgspec
import nats
import pytest
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import SchedulerInfo
from kvpager.services.connection import flush_sent
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.tokenizer.requests import Prepared
from kvpager.services.tokenizer.streams import Stream
from kvpager.services.tokenizer.watch import StreamWatch
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _submitted(tokenizer, request_id: str, instance: str, scheduler_id: str) -> Stream:
    prepared = Prepared(request_id, tokenizer.encode("Hello"), SamplingParams(), True, None)
    stream = Stream(prepared, tokenizer, f"_INBOX.{request_id}", msgpack=False)
    stream.submitted, stream.instance, stream.scheduler_id = True, instance, scheduler_id
    return stream


async def test_a_restart_moves_only_the_streams_still_on_the_pinged_instance(
    nats_server, tokenizer
):
    """Instance b's scheduler answers with a new id: its stream from before the restart moves;
    a stream that moved from b to a while the ping was out (a's scheduler id now) stays put,
    where the check once took a's id for a restart of b's and moved it again."""
    subjects = Subjects("watchtest", "a")
    watch_nc = await nats.connect(nats_server.url)
    scheduler_nc = await nats.connect(nats_server.url)
    restarted = _submitted(tokenizer, "restarted", "b", "b-old")
    moved = _submitted(tokenizer, "moved", "b", "b-new")

    async def answer_b(msg) -> None:  # meanwhile, b failed `moved` and a took it
        moved.instance, moved.scheduler_id = "a", "a-1"
        info = SchedulerInfo(executor_attached=True, scheduler_id="b-new")
        await scheduler_nc.publish(msg.reply, msgspec.msgpack.encode(info))

    await scheduler_nc.subscribe(subjects.for_instance("b").scheduler_info, cb=answer_b)
    await flush_sent(scheduler_nc)  # the server has the subscription
    moves, losses = [], []

    async def move(stream: Stream, error) -> None:
        moves.append((stream.request_id, error.message))

    async def lose(stream: Stream, error) -> None:
        losses.append(stream.request_id)

    streams = {s.request_id: s for s in (restarted, moved)}
    settings = Settings(heartbeat_interval=2.0, liveness_timeout=10.0)
    watch = StreamWatch(watch_nc, subjects, settings, streams, lose, move)
    try:
        await watch.tick()
        assert moves == [("restarted", "the scheduler restarted")]
        assert losses == []
    finally:
        await watch_nc.close()
        await scheduler_nc.close()


async def test_a_scheduler_with_no_responders_moves_its_streams(nats_server, tokenizer):
    """Nobody subscribed to b's scheduler subject (the process is gone): every stream
    submitted there moves at once, without waiting out the liveness timeout."""
    subjects = Subjects("watchtest2", "b")
    nc = await nats.connect(nats_server.url)
    streams = {"gone": _submitted(tokenizer, "gone", "b", "b-1")}
    moves = []

    async def move(stream: Stream, error) -> None:
        moves.append((stream.request_id, error.message))

    async def lose(stream: Stream, error) -> None:
        raise AssertionError("nothing is lost here")

    watch = StreamWatch(nc, subjects, Settings(heartbeat_interval=2.0), streams, lose, move)
    try:
        await watch.tick()
        assert moves == [("gone", "the scheduler stopped")]
    finally:
        await nc.close()
