"""Suffix decoding served over NATS: `KVPAGER_SPECULATIVE_CONFIG` reaches the executor and the
scheduler services; a prompt asked again gets the first answer proposed from the global
cache (the tiny random model rarely repeats itself, so these are the accepted proposals),
with the same greedy tokens, and every block is free after."""

import json

import pytest
from kvpager.services.client import Client

from tests.engine.helpers import random_prompts
from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 8}


@pytest.fixture(scope="module")
def services(nats_server, tiny_llama, tmp_path_factory):  # noqa: F811
    running = start_services(
        nats_server.url,
        tiny_llama,
        tmp_path_factory.mktemp("logs"),
        prefix="suffix",
        KVPAGER_SPECULATIVE_CONFIG=json.dumps(SUFFIX),
        KVPAGER_DTYPE="float32",
    )
    yield running
    stop_and_check(running)


async def greedy(client: Client, prompt: list[int]) -> list[int]:
    events = client.generate(prompt_token_ids=prompt, temperature=0.0, max_tokens=32)
    return [t async for e in events for t in e.token_ids]


async def test_an_answer_asked_again_is_proposed_from_the_cache(client: Client):
    prompt = random_prompts([20], seed=5)[0]
    first = await greedy(client, prompt)
    before = await client.stats()
    again = await greedy(client, prompt)
    stats = await wait_all_blocks_free(client)
    assert again == first and len(first) == 32
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted > 16, stats
