"""Recurrent hybrids (Granite 4's `granitemoehybrid`, Nemotron-H's `nemotron_h`) served over
NATS: the executor announces its state slots and snapshot rows, and a second request with the
same 64-token prompt reports cached tokens (resumed from a state snapshot) and the same output,
equal to transformers' greedy one (issue 46's done criterion, served)."""

import pytest
from kvpager.services.client import Client

from tests.engine.helpers import random_prompts
from tests.engine.model.test_parity import hf_greedy
from tests.model_families import build_granite_hybrid, build_nemotron_h
from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free

PROMPT = random_prompts([64], seed=11)[0]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=[build_granite_hybrid, build_nemotron_h])
def granite(request, tmp_path_factory):
    return request.param(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def services(nats_server, granite, tmp_path_factory):  # noqa: F811
    env = {"KVPAGER_NUM_BLOCKS": "64", "KVPAGER_DTYPE": "float32"}
    running = start_services(nats_server.url, granite, tmp_path_factory.mktemp("logs"), **env)
    yield running
    stop_and_check(running)


async def tokens_of(client: Client, prompt: list[int]) -> tuple[list[int], int]:
    events = [
        e
        async for e in client.generate(
            prompt_token_ids=prompt, temperature=0.0, max_tokens=MAX_TOKENS
        )
    ]
    return [t for e in events for t in e.token_ids], events[-1].usage.num_cached_prompt_tokens


async def test_a_repeated_prompt_reports_cached_tokens_and_the_same_output(client: Client, granite):
    first, cached_first = await tokens_of(client, PROMPT)
    second, cached_second = await tokens_of(client, PROMPT)
    assert first == second == hf_greedy(granite, [PROMPT], MAX_TOKENS)[0]
    assert cached_first == 0 and cached_second >= 32, cached_second
    stats = await wait_all_blocks_free(client)
    assert stats.state_snapshot_hits == 1 and stats.state_snapshot_hit_tokens == cached_second
    assert stats.num_state_snapshots > 0 and stats.state_snapshot_bytes > 0
