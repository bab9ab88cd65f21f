"""Drain migration with blocks on `kvpager serve --replicas 2`: streams running on an instance
that drains (`kvpager drain`'s request, then SIGTERM of an instance's processes) move with
their KV blocks and go on elsewhere, token for token what an undrained run gives (greedy and
seeded), without recomputing their prompts (the target's stats count the blocks that came,
no transfer failed), and every block is free on both instances after."""

import asyncio
import signal
import time

import msgspec
import nats
import psutil
import pytest
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.schemas.kv_transfer import DrainInstance, DrainResult
from kvpager.services import credentials
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats

from tests.nats_server import free_port
from tests.services.kvpager_cli import kvpager, start, wait_for_line

NUM_STREAMS, NUM_TOKENS = 8, 512  # still running when the drain comes (after its settle time)


@pytest.fixture(params=["auto", "nats"])
def served(tiny_llama, tmp_path, request):
    """Blocks over NIXL (when installed) and over the NATS fallback."""
    port = free_port()
    process = start(
        "serve", "--model", str(tiny_llama), "--nats-port", str(port), "--num-blocks", "256",
        "--no-http", "--replicas", "2", "--drain-timeout", "30", "--kv-transfer", request.param,
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        wait_for_line(process, tmp_path / "out.txt", "kvpager: ready")
        yield process, f"nats://127.0.0.1:{port}"
        fallback = "kv transfer over NATS" in (tmp_path / "err.txt").read_text()
        assert fallback == (request.param == "nats" or not nixl.available())  # and says so
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except Exception:
                process.kill()
        process.wait()


def _fields(i: int) -> dict:
    seeded = dict(temperature=1.0, top_p=0.9, seed=100 + i)
    sampling = dict(temperature=0.0) if i % 2 else seeded  # greedy and seeded streams
    prompt = [10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] * 3
    return dict(prompt_token_ids=prompt, max_tokens=NUM_TOKENS, ignore_eos=True, **sampling)


async def _stream(client: Client, i: int, first: asyncio.Event | None = None) -> list[int]:
    tokens, final = [], None
    async for event in client.generate(**_fields(i)):
        tokens += event.token_ids
        final = event
        if first is not None and len(tokens) >= 2:
            first.set()
    assert final.finish_reason == "length" and final.error is None, final
    return tokens


async def _service_nc(url: str):
    service = credentials.load(credentials.identity_path(credentials.SERVICE))
    return await nats.connect(url, **service.connect_options())


async def _drain_request(url: str, instance: str) -> DrainResult:
    nc = await _service_nc(url)
    try:
        subject = f"llm.internal.{instance}.scheduler.drain"
        reply = await nc.request(subject, msgspec.msgpack.encode(DrainInstance(instance)), 30.0)
        return msgspec.msgpack.decode(reply.data, type=DrainResult)
    finally:
        await nc.close()


async def _all_free(client: Client, timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
        if all(s.num_used_blocks == 0 for s in stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def _moved_streams(url: str, drain) -> tuple[list[list[int]], list, str]:
    """Every stream started, then `drain(instance)` of the instance running most of them:
    the streams' tokens once they ended, each instance's stats, and the drained instance."""
    client = await Client.connect(url, "llm")
    try:
        first = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(_stream(client, i, first[i])) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60.0)
        stats = await gather_stats(client.nc, "llm.stats", 1.0)
        source = max(stats, key=lambda s: s.num_running)
        assert source.num_running > 0 and len(stats) == 2, stats
        assert not any(task.done() for task in tasks), "streams ended before the drain"
        await drain(source.instance)
        moved = await asyncio.wait_for(asyncio.gather(*tasks), 90.0)
        return moved, await _all_free(client), source.instance
    finally:
        await client.close()


async def _undrained(url: str) -> list[list[int]]:
    client = await Client.connect(url, "llm")
    try:
        return list(await asyncio.gather(*(_stream(client, i) for i in range(NUM_STREAMS))))
    finally:
        await client.close()


def _check_target(stats: list, source: str) -> None:
    by_name = {s.instance: s for s in stats}
    target = by_name[next(name for name in by_name if name != source)]
    assert target.kv_transfer_blocks > 0 and target.kv_transfer_bytes > 0, target
    assert target.kv_transfer_failed == 0, target
    for s in stats:
        assert s.num_used_blocks == 0 and s.num_running == s.num_waiting == 0, s


def test_kvpager_drain_moves_streams_with_their_blocks(served):
    process, url = served
    results: list[DrainResult] = []

    async def drain(instance: str) -> None:
        results.append(await _drain_request(url, instance))

    moved, stats, source = asyncio.run(_moved_streams(url, drain))
    assert results[0].num_moved > 0, results
    _check_target(stats, source)
    drained = next(s for s in stats if s.instance == source)
    assert drained.kv_handoffs == results[0].num_moved, drained
    assert moved == asyncio.run(_undrained(url))  # the drained instance refuses: the other
    done = kvpager("drain", source, "--nats-url", url)  # the CLI, as the services' identity
    assert done.returncode == 0, done.stderr
    assert f"instance {source} drains: 0 streams moved" in done.stdout, done.stdout
    missing = kvpager("drain", "no-such-instance", "--nats-url", url)
    assert missing.returncode == 1 and "no instance" in missing.stderr, missing


def test_sigterm_of_an_instance_moves_its_streams(served):
    process, url = served
    children = psutil.Process(process.pid).children(recursive=True)

    async def drain(instance: str) -> None:
        pair = [p for p in children if p.environ().get("KVPAGER_INSTANCE") == instance]
        assert len(pair) == 2, pair  # its executor and scheduler
        for child in pair:
            child.send_signal(signal.SIGTERM)

    moved, stats, source = asyncio.run(_moved_streams(url, drain))
    assert moved == asyncio.run(_undrained(url))
    _check_target(stats, source)
