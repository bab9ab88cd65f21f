"""`cache` on llm.generate over a real nats-server: the first call writes a pinned prefix, a
flood evicts an unpinned prefix of the same size, the second call still reads the pinned one."""

import random
from collections.abc import Iterator

import msgspec
import pytest
from kvpager.schemas.public import PromptCache
from kvpager.services.client import Client

from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.conftest import Services, start_services, stop_and_check

BLOCK = 16


@pytest.fixture(scope="module")
def services(nats_server, tiny_llama, tmp_path_factory) -> Iterator[Services]:  # noqa: F811
    """A small cache (24 blocks of 16 tokens, no CPU tier) that a few prompts turn over."""
    env = {"KVPAGER_NUM_BLOCKS": "24", "KVPAGER_SWAP_SPACE": "0"}
    running = start_services(nats_server.url, tiny_llama, tmp_path_factory.mktemp("logs"), **env)
    yield running
    stop_and_check(running)


def ids(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(num_tokens)]  # no special tokens


async def final_usage(client: Client, **fields):
    events = [event async for event in client.generate(temperature=0.0, max_tokens=2, **fields)]
    assert events[-1].is_final and events[-1].error is None, events[-1]
    return events[-1].usage


async def test_a_pinned_prefix_is_read_after_a_flood(client: Client):
    pinned, unpinned = ids(4 * BLOCK, 1), ids(4 * BLOCK, 2)
    cache = PromptCache(prefix_tokens=4 * BLOCK, ttl=300.0)
    first = await final_usage(client, prompt_token_ids=pinned + [7], cache=cache)
    assert first.num_cache_write_tokens == 4 * BLOCK and first.num_cached_prompt_tokens == 0
    await final_usage(client, prompt_token_ids=unpinned + [7])
    for seed in range(3, 7):  # one-shot requests of 13 blocks each: the cache turns over
        await final_usage(client, prompt_token_ids=ids(200, seed))
    assert (await client.stats()).num_pinned_blocks == 4
    second = await final_usage(client, prompt_token_ids=pinned + [8], cache=cache)
    assert second.num_cached_prompt_tokens == 4 * BLOCK
    assert second.cached_tokens_by_tier == {"device": 4 * BLOCK}
    assert second.num_cache_write_tokens == 0  # read, and its pin refreshed
    other = await final_usage(client, prompt_token_ids=unpinned + [8])
    assert other.num_cached_prompt_tokens == 0  # the unpinned prefix was evicted


async def test_cache_and_priority_on_the_wire_as_json(client: Client):
    body = {
        "prompt_token_ids": ids(2 * BLOCK + 3, 9),
        "max_tokens": 1,
        "cache": {"ttl": 60},
        "priority": -5,
    }
    events = [e async for e in client.generate_raw(msgspec.json.encode(body))]
    assert events[-1].error is None and events[-1].usage.num_cache_write_tokens == 2 * BLOCK
    body["cache"] = {"prefix_tokens": 99}
    events = [e async for e in client.generate_raw(msgspec.json.encode(body))]
    assert events[-1].error.type == "invalid_request" and events[-1].error.param == "cache"
