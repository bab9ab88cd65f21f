"""`kvpager serve --replicas 2`: two executor + scheduler instances behind the tokenizer, a
request served, a model nobody serves refused with a typed error, a killed executor
restarted (both instances serve again), SIGTERM stopping all."""

import asyncio
import signal
import time

import msgspec
import psutil

from schemas.scheduler import SchedulerInfo
from services.client import Client
from services.http.metrics import gather_stats
from tests.nats_server import free_port
from tests.services.kvpager_cli import start, wait_for_line


async def _check(url: str) -> None:
    client = await Client.connect(url, "llm")
    try:
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
        assert sorted(s.instance for s in stats) == ["default-0", "default-1"], stats
        events = [e async for e in client.generate(prompt="Hello", max_tokens=4, temperature=0)]
        assert events[-1].finish_reason == "length" and events[-1].error is None
        refused = [e async for e in client.generate(prompt="Hello", model="no-such-model")]
        assert refused[-1].error.type == "model_not_found", refused[-1]
    finally:
        await client.close()


def test_serve_starts_two_instances(tiny_llama, tmp_path):
    port = free_port()
    args = ["serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "64"]
    process = start(*args, "--replicas", "2", log_dir=tmp_path)
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
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


async def _executor_ids(url: str) -> list[str]:
    """Each instance's attached executor ("" while none is)."""
    client = await Client.connect(url, "llm")
    try:
        ids = []
        for instance in ("default-0", "default-1"):
            subject = f"llm.internal.{instance}.scheduler.info"
            reply = await client.nc.request(subject, b"", timeout=2.0)
            info = msgspec.msgpack.decode(reply.data, type=SchedulerInfo)
            ids.append(info.executor_id if info.executor_attached else "")
        return ids
    finally:
        await client.close()


async def _until_attached(url: str, before: list[str], timeout_s: float = 60.0) -> None:
    """Both instances have an executor again, one of them a new one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = await _executor_ids(url)
        if all(ids) and ids != before:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no new executor attached: {before} -> {ids}")
