"""`--responses-store nats`: stored responses in JetStream's key-value store, on the nats-server
`kvpager serve` starts with JetStream. A second gateway reads, continues and deletes what the
first stored; a gateway with API keys keeps its keys' responses from the open one; the store's
bound drops the oldest. Every KV block free after."""

import contextlib

import openai
import pytest
from kvpager.services.client import Client

from tests.services.conftest import wait_all_blocks_free
from tests.services.http_fixture import LIMITS_ENV, gateway, serving

MAX_STORED = 6
NATS_STORE = {"KVPAGER_RESPONSES_STORE": "nats", "KVPAGER_RESPONSES_MAX_STORED": str(MAX_STORED)}
INSTRUCTIONS = "You answer questions about the paged cache: blocks, slots and the free list."


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    """`kvpager serve` (its gateway on the NATS store) and a second, keyed gateway beside it."""
    folder = tmp_path_factory.mktemp("nats-store")
    with contextlib.ExitStack() as stack:
        served = stack.enter_context(
            serving(tiny_llama, folder / "serve", 64, {**LIMITS_ENV, **NATS_STORE})
        )
        env = {**NATS_STORE, "KVPAGER_API_KEY": "key-alpha"}
        keyed = stack.enter_context(gateway(served, tiny_llama, folder / "keyed", **env))
        yield served, keyed


def _api(url: str, key: str = "-") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


async def _all_blocks_free(nats_url: str) -> None:
    client = await Client.connect(nats_url)
    try:
        stats = await wait_all_blocks_free(client, timeout_s=10.0)
    finally:
        await client.close()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0, stats


async def test_another_gateway_reads_continues_and_deletes(stack, tiny_llama):
    served, keyed = stack
    model = tiny_llama.name
    async with _api(served.api_url) as first, _api(keyed.api_url, "key-alpha") as second:
        done = await first.responses.create(
            model=model, instructions=INSTRUCTIONS, input="What is a block?",
            max_output_tokens=4, temperature=0.0,
        )  # fmt: skip
        with pytest.raises(openai.NotFoundError):  # the keyed gateway: another owner
            await second.responses.retrieve(done.id)
        mine = await second.responses.create(
            model=model, instructions=INSTRUCTIONS, input="What is a slot?",
            max_output_tokens=4, temperature=0.0,
        )  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await first.responses.retrieve(mine.id)
        found = await second.responses.retrieve(mine.id)
        assert found.model_dump() == mine.model_dump()
        later = await second.responses.create(
            model=model, instructions=INSTRUCTIONS, input="And the free list?",
            max_output_tokens=4, temperature=0.0, previous_response_id=mine.id,
        )  # fmt: skip
        assert later.usage.input_tokens_details.cached_tokens >= mine.usage.input_tokens // 16 * 16
        with pytest.raises(openai.NotFoundError):
            await first.responses.delete(mine.id)
        await second.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            await second.responses.retrieve(mine.id)
        assert (await first.responses.retrieve(done.id)).id == done.id
    await _all_blocks_free(served.nats_url)


async def test_the_bucket_drops_the_oldest(stack, tiny_llama):
    served, _ = stack
    async with _api(served.api_url) as api:
        ids = []
        for i in range(MAX_STORED + 1):
            done = await api.responses.create(model=tiny_llama.name, input=f"N{i}",
                                              max_output_tokens=1)  # fmt: skip
            ids.append(done.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(ids[0])
        assert (await api.responses.retrieve(ids[-1])).id == ids[-1]
    await _all_blocks_free(served.nats_url)
