"""The disk tier served over NATS: a prefix evicted past the CPU pool comes back from disk
with the same tokens, the KV events report it as a disk tier, and a restart of the services
over the same folder finds it."""

import asyncio

import msgspec
import pytest
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.schemas.tokenizer import BlockStored, KvEvents
from kvpager.services.client import Client
from kvpager.services.subjects import Subjects

from tests.engine.helpers import random_prompts
from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, 16 slots, kv heads, head_dim, fp32
PROMPTS = random_prompts([80] * 8, seed=11)  # 5 blocks of 16 each


def disk_env(folder) -> dict[str, str]:
    return {
        "KVPAGER_NUM_BLOCKS": "16",
        "KVPAGER_SWAP_SPACE": str(4 * BLOCK_BYTES),
        "KVPAGER_KV_DISK_DIR": str(folder),
        "KVPAGER_KV_DISK_BYTES": "1MiB",
        "KVPAGER_KV_DISK_KEY_FILE": str(folder.with_name(folder.name + ".key")),
        "KVPAGER_DTYPE": "float32",
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def services(nats_server, tiny_llama, tmp_path_factory, folder):  # noqa: F811
    running = start_services(
        nats_server.url, tiny_llama, tmp_path_factory.mktemp("logs"), **disk_env(folder)
    )
    yield running
    stop_and_check(running)


async def tokens_of(client: Client, prompt: list[int]) -> tuple[list[int], int]:
    events = [
        e async for e in client.generate(prompt_token_ids=prompt, temperature=0.0, max_tokens=4)
    ]
    return [t for e in events for t in e.token_ids], events[-1].usage.num_cached_prompt_tokens


async def test_a_prefix_comes_back_from_disk_and_events_say_so(client: Client, services):
    decoder = msgspec.msgpack.Decoder(KvEvents)
    on_disk: set[bytes] = set()

    async def note(msg) -> None:
        for event in decoder.decode(msg.data).events:
            if isinstance(event, BlockStored) and event.tier == "disk":
                on_disk.add(event.block_hash)

    sub = await client.nc.subscribe(Subjects(services.prefix, "default").kv_events, cb=note)
    fresh = [await tokens_of(client, p) for p in PROMPTS]
    assert [cached for _, cached in fresh] == [0] * len(PROMPTS)
    await asyncio.sleep(0.5)  # the last events
    first_blocks = prompt_block_hashes(PROMPTS[0], 16)[:4]
    assert set(first_blocks) <= on_disk
    again, cached = await tokens_of(client, PROMPTS[0])
    assert again == fresh[0][0] and cached == 64
    stats = await wait_all_blocks_free(client)
    assert stats.num_disk_loaded_blocks == 4 and stats.num_disk_stored_blocks > 0
    await sub.unsubscribe()


def test_a_restart_finds_the_folder(nats_server, tiny_llama, tmp_path, folder):  # noqa: F811
    # runs after the module's services wrote the folder; a second set starts over it
    async def run() -> tuple[list[int], int, int]:
        client = await Client.connect(nats_server.url, "disk2")
        try:
            tokens, cached = await tokens_of(client, PROMPTS[1])
            stats = await wait_all_blocks_free(client)
            return tokens, cached, stats.num_disk_loaded_blocks
        finally:
            await client.close()

    again = start_services(
        nats_server.url, tiny_llama, tmp_path / "logs", prefix="disk2", **disk_env(folder)
    )
    try:
        tokens, cached, loaded = asyncio.run(run())
    finally:
        stop_and_check(again)
    assert cached == 64 and loaded == 4
    with_no_disk = start_services(
        nats_server.url, tiny_llama, tmp_path / "logs2", prefix="disk3", KVPAGER_DTYPE="float32"
    )
    try:

        async def fresh() -> list[int]:
            client = await Client.connect(nats_server.url, "disk3")
            try:
                return (await tokens_of(client, PROMPTS[1]))[0]
            finally:
                await client.close()

        assert asyncio.run(fresh()) == tokens
    finally:
        stop_and_check(with_no_disk)
