"""`kvpager serve --replicas 2`: two executor + scheduler instances behind the tokenizer, a
request served, a model nobody serves refused with a typed error, SIGTERM stopping all."""

import asyncio
import signal

import psutil

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
        asyncio.run(_check(f"nats://127.0.0.1:{port}"))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
