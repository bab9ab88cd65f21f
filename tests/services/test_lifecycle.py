"""Start-up order and back-pressure: the scheduler waits for its executor; a full queue
answers "overloaded" at once."""

import asyncio

import pytest
from kvpager.services.client import Client

from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

PREFIX = "small"


@pytest.fixture(scope="module")
def late_executor(nats_server, tiny_llama, tmp_path_factory):
    services = start_services(
        nats_server.url,
        tiny_llama,
        tmp_path_factory.mktemp("small"),
        prefix=PREFIX,
        names=("scheduler", "tokenizer"),
        KVPAGER_MAX_NUM_SEQS="1",
        KVPAGER_MAX_WAITING="1",
        KVPAGER_DRAIN_TIMEOUT="60",  # a loaded machine still finishes the stream
    )
    yield services
    stop_and_check(services)


async def _until_tokenizer_answers(client: Client) -> str:
    for _ in range(300):
        try:
            return (await client.health(timeout=1.0)).message
        except Exception:  # the tokenizer is still loading
            await asyncio.sleep(0.1)
    raise TimeoutError("no tokenizer")


async def test_scheduler_waits_for_its_executor(late_executor):
    client = await Client.connect(late_executor.url, PREFIX)
    try:
        assert "executor" in await _until_tokenizer_answers(client)
        events = [e async for e in client.generate(prompt="early")]
        assert events[-1].error.type == "unavailable"
        late_executor.launch("executor")
        await asyncio.to_thread(late_executor.wait_healthy)
        events = [e async for e in client.generate(prompt="on time", max_tokens=2)]
        assert events[-1].finish_reason == "length"
    finally:
        await client.close()


async def test_full_waiting_queue_is_overloaded(late_executor):
    client = await Client.connect(late_executor.url, PREFIX)
    long = dict(prompt="Once upon a time", max_tokens=500, ignore_eos=True)
    running, waiting = (client.generate(request_id=f"q{i}", **long) for i in range(2))
    try:
        assert (await anext(running)).request_id == "q0"
        queued = asyncio.create_task(anext(waiting))  # max_num_seqs 1: it waits
        while (await client.stats()).num_waiting == 0:
            await asyncio.sleep(0.02)
        events = [e async for e in client.generate(prompt="one too many")]
        assert len(events) == 1 and events[0].error.type == "overloaded"
        await client.abort("q0")
        assert (await queued).request_id == "q1"  # runs once q0 is gone
    finally:
        await running.aclose()
        await waiting.aclose()
        stats = await wait_all_blocks_free(client)
        await client.close()
    assert stats.num_used_blocks == 0 and stats.num_running == 0


async def test_tokenizer_replicas_share_the_load(late_executor):
    late_executor.launch("tokenizer2", "tokenizer")
    for _ in range(300):
        if any("tokenizer ready" in line for line in late_executor.log_lines("tokenizer2")):
            break
        await asyncio.sleep(0.1)
    client = await Client.connect(late_executor.url, PREFIX)
    try:
        for i in range(12):  # max_num_seqs 1: one after the other
            events = [
                e async for e in client.generate(request_id=f"r{i}", prompt="hi", max_tokens=2)
            ]
            assert [e.seq for e in events] == [0, 1] and events[-1].finish_reason == "length"
    finally:
        await client.close()
    for name in ("tokenizer", "tokenizer2"):
        queued = [line for line in late_executor.log_lines(name) if "request queued" in line]
        assert queued, f"{name} served nothing"


async def test_shutdown_lets_streams_finish(late_executor):
    """SIGTERM to all three at once (as Ctrl-C does): the stream still ends properly."""
    client = await Client.connect(late_executor.url, PREFIX)
    try:
        stream = client.generate(prompt="Once upon a time", max_tokens=100, ignore_eos=True)
        events = [await anext(stream)]
        codes = asyncio.create_task(asyncio.to_thread(late_executor.stop))
        events += [event async for event in stream]
        assert events[-1].finish_reason == "length"
        assert events[-1].usage.num_completion_tokens == 100
        assert set((await codes).values()) == {0}
    finally:
        await client.close()
