"""A continued conversation goes to the instance that caches it: `kvpager serve --replicas 2`
with the kv router, several conversations through the Responses API, each later turn served
from the prefix cache (round-robin would miss about half of them). Blocks all free after."""

import asyncio

import openai
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats

from tests.services.conftest import wait_all_blocks_free
from tests.services.http_fixture import LIMITS_ENV, serving

BLOCK = 16
NUM_CONVERSATIONS, NUM_TURNS = 4, 3
INSTRUCTIONS = "You answer questions about the paged cache: blocks, slots and the free list."


async def _conversation(api: openai.AsyncOpenAI, model: str, index: int) -> list:
    instructions = f"Conversation {index}. {INSTRUCTIONS}"  # its own first block
    turns, previous = [], None
    for turn in range(NUM_TURNS):
        done = await api.responses.create(
            model=model, instructions=instructions, input=f"Question {turn}?",
            max_output_tokens=4, temperature=0.0, previous_response_id=previous,
        )  # fmt: skip
        turns.append(done)
        previous = done.id
    return turns


async def _run(served) -> list[list]:
    async with openai.AsyncOpenAI(base_url=served.api_url, api_key="-", max_retries=0) as api:
        model = (await api.models.list()).data[0].id
        jobs = [_conversation(api, model, i) for i in range(NUM_CONVERSATIONS)]
        return await asyncio.gather(*jobs)


async def _instances(nats_url: str):
    client = await Client.connect(nats_url)
    try:
        await wait_all_blocks_free(client, timeout_s=10.0)
        return await gather_stats(client.nc, client.subjects.stats, 1.0)
    finally:
        await client.close()


def test_later_turns_go_where_their_prefix_is(tiny_llama, tmp_path):
    env = {**LIMITS_ENV, "KVPAGER_REPLICAS": "2"}
    with serving(tiny_llama, tmp_path, 64, env) as served:
        conversations = asyncio.run(_run(served))
        stats = asyncio.run(_instances(served.nats_url))
    assert len(stats) == 2 and all(sum(s.num_finished.values()) > 0 for s in stats), stats
    for s in stats:
        assert s.num_used_blocks == 0 and s.num_running == s.num_waiting == 0, s
    for turns in conversations:
        for earlier, later in zip(turns, turns[1:]):
            cached = later.usage.input_tokens_details.cached_tokens
            # every whole block of the earlier turn's prompt was read from the cache
            assert cached >= earlier.usage.input_tokens // BLOCK * BLOCK, (earlier, later)
