"""Anthropic's `cache_control` kept as a retention contract, end to end: the anthropic SDK
against `kvpager serve` with a small cache and no CPU tier. A 300-word system block marked
`cache_control` is written (cache_creation_input_tokens), read back (cache_read_input_tokens),
and still read after a flood has evicted an unmarked system prompt of the same size."""

import random
from collections.abc import AsyncIterator, Iterator

import anthropic
import pytest
from kvpager.services.client import Client

from tests.services.conftest import wait_all_blocks_free
from tests.services.http_fixture import Served, serving

NUM_BLOCKS = 150  # of 16 tokens: a 300-word system prompt here is ~50 blocks
WORDS = "the quick brown fox jumps over a lazy dog and runs to its den".split()
GREEDY = {"temperature": 0.0}
HI = [{"role": "user", "content": "Hi"}]


def system_words(seed: int, num_words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@pytest.fixture(scope="module")
def small_cache(tiny_llama, tmp_path_factory) -> Iterator[Served]:
    env = {"KVPAGER_SWAP_SPACE": "0", "KVPAGER_CHECK_INVARIANTS": "true"}
    log_dir = tmp_path_factory.mktemp("messages-pins")
    with serving(tiny_llama, log_dir, NUM_BLOCKS, env) as found:
        yield found


@pytest.fixture
async def claude(small_cache) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(base_url=small_cache.base_url, api_key="x", max_retries=0)
    yield client
    await client.close()
    nats = await Client.connect(small_cache.nats_url)
    stats = await wait_all_blocks_free(nats, timeout_s=10.0)
    await nats.close()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks, stats


async def ask(claude, tiny_llama, system) -> anthropic.types.Usage:
    message = await claude.messages.create(
        model=tiny_llama.name, max_tokens=2, system=system, messages=HI, extra_body=GREEDY
    )
    return message.usage


async def test_a_marked_system_block_is_written_read_and_kept_through_a_flood(
    claude, tiny_llama, small_cache
):
    marked = [{"type": "text", "text": system_words(1), "cache_control": {"type": "ephemeral"}}]
    unmarked = system_words(2)
    first = await ask(claude, tiny_llama, marked)
    assert first.cache_creation_input_tokens >= 40 * 16 and first.cache_read_input_tokens == 0
    again = await ask(claude, tiny_llama, marked)
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert again.cache_creation_input_tokens == 0  # read, its pin refreshed
    assert (await ask(claude, tiny_llama, unmarked)).cache_read_input_tokens == 0
    for seed in range(3, 8):  # one-shot prompts of the same size: the cache turns over
        await ask(claude, tiny_llama, system_words(seed))
    kept = await ask(claude, tiny_llama, marked)
    assert kept.cache_read_input_tokens >= first.cache_creation_input_tokens
    evicted = await ask(claude, tiny_llama, unmarked)
    assert evicted.cache_read_input_tokens == 0  # the unmarked prompt of the same size is gone
