"""Every internal message fits the wire when the server allows little: a nats-server with a
16 KiB max_payload, so that ordinary requests need steps in several messages (StepRequests),
step outputs in parts (StepParts), token batches and final events in pieces, and results equal
the offline engine's."""

import asyncio
import math
import random
import time

import pytest
from kvpager.engine import LLM, SamplingParams
from kvpager.services.client import Client

from tests.models import build_llama
from tests.nats_server import NatsServer
from tests.services.conftest import start_services, stop_and_check, wait_all_blocks_free
from tests.services.test_generate import collect

MAX_PAYLOAD = 16384
WITHIN_S = 60.0  # the step timeout is 300 s: nothing waited for it
VICTIM = {"prompt": "The quick brown fox", "temperature": 0.0, "max_tokens": 32}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory):
    config = tmp_path_factory.mktemp("nats") / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    server = NatsServer(extra_args=("-c", str(config)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def services(small_nats, long_llama, tmp_path_factory):
    env = {"KVPAGER_NUM_BLOCKS": "512", "KVPAGER_MAX_NUM_BATCHED_TOKENS": "1024"}
    env["KVPAGER_MAX_PROMPT_LOGPROB_VALUES"] = "50000"  # 21 x 1,800 fit, 21 x 3,000 do not
    running = start_services(small_nats.url, long_llama, tmp_path_factory.mktemp("logs"), **env)
    yield running
    stop_and_check(running)


@pytest.fixture(scope="module")
def offline(long_llama) -> LLM:
    return LLM(str(long_llama), seed=0)


@pytest.fixture
async def client(services):
    client = await Client.connect(services.url, services.prefix)
    assert client.nc.max_payload == MAX_PAYLOAD
    yield client
    await wait_all_blocks_free(client, timeout_s=10.0)
    await client.close()


def _tokens(events) -> list[int]:
    assert events[-1].is_final and events[-1].error is None, events[-1]
    return [t for event in events for t in event.token_ids]


async def _beside(client: Client, jobs: list) -> list:
    """The jobs' results while a victim streams; the victim equals an undisturbed run."""
    alone = _tokens(await collect(client.generate(**VICTIM)))
    started = time.monotonic()
    *results, beside = await asyncio.gather(*jobs, collect(client.generate(**VICTIM)))
    assert _tokens(beside) == alone
    assert time.monotonic() - started < WITHIN_S
    return results


async def test_a_step_of_64_requests_with_16_stop_strings_each(client, offline):
    stop = [f"{i:02d}" + "~" * 98 for i in range(16)]  # 1.7 KB of params a request
    prompts = [f"Paged attention number {i} stores" for i in range(64)]
    jobs = [
        collect(client.generate(prompt=p, stop=stop, temperature=0.0, max_tokens=6))
        for p in prompts
    ]
    results = await _beside(client, jobs)
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=stop)
    expected = offline.generate(prompts, params, use_tqdm=False)
    assert [_tokens(r) for r in results] == [e.outputs[0].token_ids for e in expected]


async def test_beam_candidates_travel_in_step_parts(client, offline):
    stop_ids = list(range(100, 300))  # 16 beams x 216 candidates: over 16 KiB a step
    request = {"beam_width": 16, "n": 2, "max_tokens": 6, "temperature": 0.0}
    prompt = "Once upon a time"
    jobs = [collect(client.generate(**request, prompt=prompt, stop_token_ids=stop_ids))]
    (events,) = await _beside(client, jobs)
    params = SamplingParams(**request, stop_token_ids=stop_ids)
    (expected,) = offline.beam_search([prompt], params, use_tqdm=False)
    by_index: dict[int, list[int]] = {}
    for event in events:
        by_index.setdefault(event.index, []).extend(event.token_ids)
    assert [by_index[i] for i in range(2)] == [o.token_ids for o in expected.outputs]


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_logprobs_on_1800_tokens_come_in_pieces(client, offline, stream):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 384) for _ in range(1800)]
    request = {"prompt_token_ids": prompt, "prompt_logprobs": 20, "max_tokens": 1}
    jobs = [collect(client.generate(**request, temperature=0.0, stream=stream))]
    (events,) = await _beside(client, jobs)
    _tokens(events)
    rows = [row for event in events for row in (event.prompt_logprobs or [])]
    assert len(events) > 10 and len(rows) == len(prompt) and rows[0] is None
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
    (expected,) = offline.generate([prompt], params, use_tqdm=False)
    for row, want, token_id in zip(rows[1:], expected.prompt_logprobs[1:], prompt[1:]):
        assert row.token_id == token_id
        assert math.isclose(row.logprob, want[token_id].logprob, abs_tol=1e-4)
        assert row.rank == want[token_id].rank


async def test_sampling_params_over_a_quarter_of_max_payload_are_refused(client):
    stop = [f"{i:02d}" + "~" * 248 for i in range(16)]  # 4 KB: over 16 KiB / 4
    events = await collect(client.generate(prompt="Hello", stop=stop, max_tokens=2))
    error = events[-1].error
    assert error.type == "invalid_request" and "max_payload" in error.message


async def test_prompt_logprob_values_are_bounded(client):
    prompt = [random.Random(2).randrange(3, 384) for _ in range(3000)]
    events = await collect(client.generate(prompt_token_ids=prompt, prompt_logprobs=20))
    error = events[-1].error
    assert error.type == "invalid_request" and error.param == "prompt_logprobs"
    assert "63000 prompt logprob values" in error.message and "limit (50000)" in error.message


async def test_a_final_event_over_the_limit_ends_its_stream_with_a_typed_error(client):
    request = {"prompt": "Hello", "max_tokens": 200, "logprobs": 20, "ignore_eos": True}
    jobs = [collect(client.generate(**request, temperature=0.0, stream=False))]
    (events,) = await _beside(client, jobs)
    error = events[-1].error
    assert events[-1].is_final and error.type == "invalid_request" and error.param == "logprobs"
    assert "max_payload" in error.message
