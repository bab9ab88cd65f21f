"""The services on a 3-node NATS cluster (routes on loopback), one service per node, each
given every node's URL: streams cross the routes, and when a node dies its clients fail over
to the others; streams in flight then end, complete or with a typed error, and none hangs."""

import asyncio

import pytest
from kvpager.engine import LLM, SamplingParams
from kvpager.services.client import Client

from tests.nats_server import nats_cluster
from tests.services.conftest import (
    SERVICE_NAMES,
    Services,
    _wait_healthy,
    stop_and_check,
    wait_all_blocks_free,
)

PROMPTS = ["The cat", "Once upon a time", "A paged KV cache", "NATS routes"]


def _urls(nodes, first: int) -> str:
    """Every node's URL, this one first: where the service connects, then its fallbacks."""
    ordered = nodes[first:] + nodes[:first]
    return ",".join(node.url for node in ordered)


@pytest.fixture()
def cluster(tiny_llama, tmp_path):
    nodes = nats_cluster(3)
    services = Services(_urls(nodes, 0), "llm", {}, tmp_path, {})
    services.environ = _environ(tiny_llama)
    try:
        for index, name in enumerate(SERVICE_NAMES):  # executor, scheduler, tokenizer: 0, 1, 2
            services.launch(name, KVPAGER_NATS_URL=_urls(nodes, index))
        asyncio.run(_wait_healthy(services))
        yield nodes, services
    finally:
        services.stop()
        for node in nodes:
            node.stop()


def _environ(model) -> dict[str, str]:
    import os

    from tests.services.conftest import SERVICE_ENV

    return {**os.environ, **SERVICE_ENV, "KVPAGER_MODEL": str(model), "KVPAGER_PREFIX": "llm"}


async def _texts(client: Client, prompts: list[str]) -> list[str]:
    async def one(prompt: str) -> str:
        events = [e async for e in client.generate(prompt=prompt, max_tokens=12, temperature=0.0)]
        assert events[-1].error is None, events[-1]
        return "".join(e.text for e in events)

    return await asyncio.gather(*map(one, prompts))


def test_services_spread_over_the_nodes_serve_the_offline_result(cluster, tiny_llama):
    nodes, services = cluster
    want = LLM(str(tiny_llama)).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )

    async def run() -> None:
        client = await Client.connect(_urls(nodes, 1))  # on the scheduler's node
        try:
            assert await _texts(client, PROMPTS) == [o.outputs[0].text for o in want]
            assert (await wait_all_blocks_free(client)).num_used_blocks == 0
        finally:
            await client.close()

    asyncio.run(run())
    stop_and_check(services)


async def _served_with_retries(client: Client, prompt: str) -> str:
    while True:
        events = [e async for e in client.generate(prompt=prompt, max_tokens=12, temperature=0.0)]
        error = events[-1].error
        if error is None:
            return "".join(e.text for e in events)
        assert error.type in ("unavailable", "executor_unavailable"), error
        await asyncio.sleep(0.5)


async def _until_healthy(client: Client, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            if (await client.health(timeout=1.0)).status == "ok":
                return
        except Exception:  # no responders while the tokenizer reconnects
            pass
        assert asyncio.get_running_loop().time() < deadline, "not healthy again"
        await asyncio.sleep(0.2)


async def _finals(client: Client, prompt: str) -> list:
    """Every event of one stream; it must end within the bound (no hang)."""
    events = [e async for e in client.generate(prompt=prompt, max_tokens=200, ignore_eos=True)]
    return events


def test_a_dead_node_fails_over_and_nothing_hangs(cluster):
    nodes, services = cluster

    async def run() -> None:
        client = await Client.connect(_urls(nodes, 0), max_reconnect_attempts=-1)
        try:
            streams = [asyncio.create_task(_finals(client, p)) for p in PROMPTS]
            await asyncio.sleep(1.0)
            nodes[2].stop()  # the tokenizer's node, mid-stream
            for events in await asyncio.wait_for(asyncio.gather(*streams), 120):
                final = events[-1]
                assert final.finish_reason in ("length", "error"), final
                if final.finish_reason == "error":
                    assert final.error.type in ("unavailable", "connection_lost", "internal_error")
                assert [e.seq for e in events] == list(range(len(events)))
            # the tokenizer fails over to another node, and new requests are served again (a
            # client retries "unavailable" while the services settle: see the README)
            await _until_healthy(client, 60)
            assert await asyncio.wait_for(_served_with_retries(client, PROMPTS[0]), 120)
            assert (await wait_all_blocks_free(client, 30)).num_used_blocks == 0
        finally:
            await client.close()

    asyncio.run(run())
