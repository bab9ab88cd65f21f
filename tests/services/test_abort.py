"""Aborts: explicit, by a client that goes away, by a deadline; blocks are freed at once."""

import asyncio
import contextlib

from kvpager.services.client import Client

from tests.services.conftest import wait_all_blocks_free

LONG = dict(prompt="Once upon a time", temperature=0.0, max_tokens=600, ignore_eos=True)


async def test_abort_mid_stream_frees_blocks_before_the_final_event(client: Client):
    events = []
    async for event in client.generate(request_id="abort-me", **LONG):
        events.append(event)
        if len(events) == 3:
            assert (await client.stats()).num_used_blocks > 0
            await client.abort("abort-me")
    assert events[-1].finish_reason == "abort" and events[-1].is_final
    assert [e.seq for e in events] == list(range(len(events)))
    assert len(events) < 100, "generation stopped within a few steps"
    stats = await client.stats()  # the final event follows the freeing: no polling
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    assert stats.num_finished["abort"] >= 1


async def test_closing_the_iterator_aborts(client: Client):
    before = (await client.stats()).num_finished.get("abort", 0)
    async with contextlib.aclosing(client.generate(**LONG)) as stream:
        async for event in stream:
            if event.seq == 0:  # early: 600 tokens of the tiny model take only a second or two
                break
    stats = await wait_all_blocks_free(client)
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    assert stats.num_finished["abort"] == before + 1, stats.num_finished


async def test_cancelling_the_consumer_aborts(client: Client):
    before = (await client.stats()).num_finished.get("abort", 0)
    started = asyncio.Event()

    async def consume():
        async for event in client.generate(**LONG):
            if event.seq == 0:
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stats = await wait_all_blocks_free(client)
    assert stats.num_running == 0
    assert stats.num_finished["abort"] == before + 1, stats.num_finished


async def test_timeout_aborts_with_a_typed_error(client: Client):
    events = [event async for event in client.generate(timeout=0.3, **LONG)]
    final = events[-1]
    assert final.finish_reason == "abort" and final.error.type == "deadline_exceeded"
    assert 0 < final.usage.num_completion_tokens < 600


async def test_deadline_already_passed(client: Client):
    events = [event async for event in client.generate(deadline=1.0, **LONG)]
    assert len(events) == 1 and events[0].error.type == "deadline_exceeded"


async def test_abort_ends_every_parallel_sample(client: Client):
    events = []
    async for event in client.generate(request_id="many", n=3, seed=1, **LONG):
        events.append(event)
        if len(events) == 6:
            await client.abort("many")
    finals = [event for event in events if event.finish_reason is not None]
    assert sorted(event.index for event in finals) == [0, 1, 2]
    assert {event.finish_reason for event in finals} == {"abort"}
    assert events[-1].is_final and sum(event.is_final for event in events) == 3  # one a sample
    assert (await client.stats()).num_used_blocks == 0


async def test_abort_during_prefill_ends_samples_not_yet_forked(client: Client):
    prompt_ids = [(5 * i) % 300 + 3 for i in range(700)]  # three prefill steps of 256
    stream = client.generate(request_id="early", n=3, prompt_token_ids=prompt_ids, max_tokens=60)
    task = asyncio.create_task(collect_all(stream))
    await asyncio.sleep(0.02)  # the request is on its way; its prompt takes three steps
    await client.abort("early")
    events = await asyncio.wait_for(task, timeout=30)
    finals = [event for event in events if event.finish_reason is not None]
    assert sorted(event.index for event in finals) == [0, 1, 2]
    assert {event.finish_reason for event in finals} == {"abort"}
    assert events[-1].is_final


async def collect_all(stream) -> list:
    return [event async for event in stream]
