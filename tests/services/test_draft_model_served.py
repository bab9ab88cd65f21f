"""A draft model served over NATS: `KVPAGER_SPECULATIVE_CONFIG` with a draft's path reaches
the executor service, which loads the draft beside the target; served greedy tokens equal
plain offline decoding, proposals are accepted, and every block is free after (the client
fixture checks)."""

import json

import pytest
from kvpager.engine import SamplingParams
from kvpager.services.client import Client

from tests.engine.helpers import make_llm, random_prompts
from tests.models import build_truncated
from tests.nats_server import nats_server  # noqa: F401  (fixture)
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free


@pytest.fixture(scope="module")
def draft_path(tiny_llama, tmp_path_factory):
    return build_truncated(tiny_llama, tmp_path_factory.mktemp("served-draft"))


@pytest.fixture(scope="module")
def services(nats_server, tiny_llama, draft_path, tmp_path_factory):  # noqa: F811
    config = {"model": str(draft_path), "num_speculative_tokens": 3}
    running = start_services(
        nats_server.url,
        tiny_llama,
        tmp_path_factory.mktemp("logs"),
        prefix="draft",
        KVPAGER_SPECULATIVE_CONFIG=json.dumps(config),
        KVPAGER_DTYPE="float32",
    )
    yield running
    stop_and_check(running)


async def test_served_draft_model_keeps_greedy_tokens(client: Client, tiny_llama):
    prompts = random_prompts([12, 30], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = make_llm(tiny_llama).generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        events = client.generate(
            prompt_token_ids=prompt, temperature=0.0, max_tokens=24, ignore_eos=True
        )
        assert [t async for e in events for t in e.token_ids] == out.outputs[0].token_ids
    stats = await wait_all_blocks_free(client)
    assert stats.spec_decode_num_draft_tokens > 0, stats
