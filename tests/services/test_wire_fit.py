"""Every internal message fits the wire, at nats-server's default max_payload (1 MiB), through
`kvpager serve`: requests whose step, step output, token batch or final event would pass it
get their result (or a typed 400 naming the limit), and a stream running beside them (the
victim) finishes as it does alone, with no wait for the 300 s step timeout."""

import asyncio
import json
import random
import time

import httpx
import pytest
from kvpager.services.client import Client

from tests.models import build_llama
from tests.nats_server import free_port
from tests.services.conftest import wait_all_blocks_free
from tests.services.kvpager_cli import start, wait_for_line
from tests.services.test_generate import collect

NUM_PROMPTS = 256
WITHIN_S = 120.0  # far below the step timeout (300 s): nothing waited for it
VICTIM = {"prompt": "The quick brown fox", "temperature": 0.0, "max_tokens": 32}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny Llama with a context long enough for a 4,500-token prompt."""
    return build_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def served(long_llama, tmp_path_factory):
    nats_port, http_port = free_port(), free_port()
    args = ["serve", "--model", str(long_llama), "--nats-port", str(nats_port)]
    args += ["--num-blocks", "2048", "--http-port", str(http_port)]
    log_dir = tmp_path_factory.mktemp("wire")
    process = start(*args, log_dir=log_dir, env={"KVPAGER_CHECK_INVARIANTS": "true"})
    try:
        wait_for_line(process, log_dir / "out.txt", "kvpager: ready")
        yield f"nats://127.0.0.1:{nats_port}", f"http://127.0.0.1:{http_port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture
async def client(served):
    client = await Client.connect(served[0])
    yield client
    await wait_all_blocks_free(client, timeout_s=10.0)
    await client.close()


async def _victim(client: Client) -> list[int]:
    events = await collect(client.generate(**VICTIM))
    assert events[-1].error is None and events[-1].finish_reason == "length"
    return [t for event in events for t in event.token_ids]


async def _beside(client: Client, job) -> object:
    """`job`'s result while a victim streams; the victim's tokens equal an undisturbed run."""
    alone = await _victim(client)
    started = time.monotonic()
    result, beside = await asyncio.gather(job, _victim(client))
    assert beside == alone
    assert time.monotonic() - started < WITHIN_S
    return result


async def _post(base_url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=WITHIN_S) as http:
        model = (await http.get(f"{base_url}/models")).json()["data"][0]["id"]
        return await http.post(f"{base_url}/completions", json={"model": model, **body})


def _prompts() -> list[str]:
    return [f"Paged attention number {i} stores keys and values" for i in range(NUM_PROMPTS)]


async def test_256_prompts_with_16_long_stop_strings(served, client):
    stop = [f"{i:02d}" + "~" * 254 for i in range(16)]  # never met; 4 KiB a request
    body = {"prompt": _prompts(), "stop": stop, "max_tokens": 4, "temperature": 0.0}
    assert 17_000 < len(json.dumps(body)) < 19_000  # the probe's 17.8 KB request
    response = await _beside(client, _post(served[1], body))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == NUM_PROMPTS
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)  # stop: on EOS


def _schema() -> dict:
    """A plain object schema of about 5.6 KB (a form with described fields)."""
    properties = {
        f"field_{i:02d}": {
            "type": ["string", "integer", "boolean"][i % 3],
            "description": f"Field {i} of the customer record, as entered on the form. " * 2,
        }
        for i in range(34)
    }
    return {"type": "object", "properties": properties, "required": ["field_00"]}


async def test_256_prompts_with_a_5_6_kb_json_schema(served, client):
    schema = _schema()
    assert 5_000 < len(json.dumps(schema)) < 6_500
    form = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    body = {"prompt": _prompts(), "response_format": form, "max_tokens": 4, "temperature": 0.0}
    response = await _beside(client, _post(served[1], body))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == NUM_PROMPTS


def _long_prompt(num_tokens: int = 4500) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, 384) for _ in range(num_tokens)]


def _joined_prompt_logprobs(events) -> list:
    joined = [row for event in events for row in (event.prompt_logprobs or [])]
    assert sum(event.is_final for event in events) == 1 and events[-1].error is None
    return joined


@pytest.mark.parametrize("stream", [True, False])
async def test_prompt_logprobs_20_on_a_4500_token_prompt(served, client, stream):
    prompt = _long_prompt()
    request = {"prompt_token_ids": prompt, "prompt_logprobs": 20, "max_tokens": 1}
    job = collect(client.generate(**request, temperature=0.0, stream=stream))
    events = await _beside(client, job)
    rows = _joined_prompt_logprobs(events)
    assert len(events) > 2  # they did not fit one event
    assert len(rows) == len(prompt) and rows[0] is None
    assert [row.token_id for row in rows[1:]] == prompt[1:]
    assert all(len(row.top_token_ids) == 20 for row in rows[1:])
    if not stream:
        assert [event.finish_reason for event in events[:-1]] == [None] * (len(events) - 1)


async def test_prompt_logprobs_over_http_join_in_the_response(served):
    prompt = _long_prompt(1800)
    body = {"prompt": prompt, "prompt_logprobs": 20, "max_tokens": 1}
    response = await _post(served[1], body)
    assert response.status_code == 200, response.text
    rows = response.json()["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(prompt) and rows[0] is None


async def test_beam_width_16_with_3152_stop_token_ids_is_a_typed_400(served, client):
    request = {"prompt": "Once upon a time", "beam_width": 16, "temperature": 0.0}
    job = collect(client.generate(**request, stop_token_ids=list(range(3152)), max_tokens=8))
    events = await _beside(client, job)
    error = events[-1].error
    assert error.type == "invalid_request" and error.param == "stop_token_ids"
    assert "3152 stop token ids is over this server's limit (256)" in error.message
    # within the limits, the same search runs
    events = await collect(client.generate(**request, stop_token_ids=[5, 6, 7], max_tokens=8))
    assert all(event.error is None for event in events) and events[-1].is_final
