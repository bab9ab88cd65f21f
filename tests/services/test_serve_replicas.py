"""`kvpager serve --replicas 2`: two executor + scheduler instances behind the tokenizer, a
request served, a model nobody serves refused with a typed error, a killed executor
restarted (both instances serve again), and SIGTERM with streams in flight on both
instances: every stream drains to its end, then everything stops."""

import asyncio
import signal
import subprocess
import time

import msgspec
import nats
import psutil
from kvpager.schemas.scheduler import SchedulerInfo
from kvpager.services import credentials
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats

from tests.nats_server import free_port
from tests.services.kvpager_cli import start, wait_for_line


async def _check(url: str) -> None:
    client = await Client.connect(url, "llm")
    try:
        stats = await _both_stats(client)
        assert [s.instance for s in stats] == ["default-0", "default-1"], stats
        events = [e async for e in client.generate(prompt="Hello", max_tokens=4, temperature=0)]
        assert events[-1].finish_reason == "length" and events[-1].error is None
        refused = [e async for e in client.generate(prompt="Hello", model="no-such-model")]
        assert refused[-1].error.type == "model_not_found", refused[-1]
    finally:
        await client.close()


def test_serve_starts_two_instances(tiny_llama, tmp_path):
    port = free_port()
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "320"]
    # a generous drain: a loaded machine still finishes the streams (with no drain at all
    # they would fail at once, whatever the timeout)
    process = start(
        *args, "--no-http", "--replicas", "2", "--drain-timeout", "30", log_dir=tmp_path
    )
    try:
        wait_for_line(process, tmp_path / "out.txt", "kvpager: ready")
        children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) == 6, children  # nats-server, 2 x (executor, scheduler), tokenizer
        url = f"nats://127.0.0.1:{port}"
        asyncio.run(_check(url))
        before = asyncio.run(_executor_ids(url))
        executor = next(p for p in children if "executor" in p.cmdline())
        executor.kill()  # serve starts it again; its instance's streams would move meanwhile
        asyncio.run(_until_attached(url, before))
        asyncio.run(_check(url))
        children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) == 6, children
        streams = asyncio.run(_drained(url, process))
        for events in streams:
            final = events[-1]
            assert final.finish_reason == "length" and final.error is None, final.error
            assert sum(len(e.token_ids) for e in events) == DRAIN_TOKENS
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _executor_ids(url: str) -> list[str]:
    """Each instance's attached executor ("" while none is), asked as the services' user
    (the internal subjects are its alone)."""
    service = credentials.load(credentials.identity_path(credentials.SERVICE))
    nc = await nats.connect(url, **service.connect_options())
    try:
        ids = []
        for instance in ("default-0", "default-1"):
            subject = f"llm.internal.{instance}.scheduler.info"
            reply = await nc.request(subject, b"", timeout=2.0)
            info = msgspec.msgpack.decode(reply.data, type=SchedulerInfo)
            ids.append(info.executor_id if info.executor_attached else "")
        return ids
    finally:
        await nc.close()


async def _until_attached(url: str, before: list[str], timeout_s: float = 60.0) -> None:
    """Both instances have an executor again, one of them a new one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = await _executor_ids(url)
        if all(ids) and ids != before:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no new executor attached: {before} -> {ids}")


# still running when the signal goes: at 128 tokens the tiny model finished one instance's
# streams within the second the stats take on a quick host (2026-12-05, AVX2 EPYC); 512 take
# several seconds. 16 streams of 33 blocks, about 8 an instance, fit 320 blocks.
NUM_DRAIN_STREAMS, DRAIN_TOKENS = 16, 512


async def _drained(url: str, process: subprocess.Popen) -> list[list]:
    """SIGTERM to serve once every stream has an event and both instances run some; each
    stream's events (they must go on to their end: the services drain)."""
    client = await Client.connect(url, "llm")
    try:
        first = [asyncio.Event() for _ in range(NUM_DRAIN_STREAMS)]
        tasks = [asyncio.create_task(_stream(client, i, first[i])) for i in range(len(first))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60.0)
        stats = await _both_stats(client)
        assert [s.num_running > 0 for s in stats] == [True, True], stats
        assert not any(task.done() for task in tasks), "streams ended before the signal"
        process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
    finally:
        await client.close()


async def _both_stats(client: Client, tries: int = 10) -> list:
    """Both instances' stats, by name (on a loaded host one may answer after the gather)."""
    for _ in range(tries):
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
        if len(stats) == 2:
            return sorted(stats, key=lambda s: s.instance)
    raise AssertionError(f"both instances' stats never came: {stats}")


async def _stream(client: Client, i: int, first: asyncio.Event) -> list:
    """One greedy stream of DRAIN_TOKENS tokens; `first` is set at its first event."""
    events = []
    prompt = [10 + i, 20 + i, 30 + i, 40 + i]
    fields = dict(max_tokens=DRAIN_TOKENS, temperature=0.0, ignore_eos=True)
    async for event in client.generate(prompt_token_ids=prompt, **fields):
        events.append(event)
        first.set()
    return events
