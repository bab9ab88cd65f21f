"""The OpenAI-compatible gateway of `kvpager serve --http-port`, through the official `openai`
client and raw server-sent events: the same text as `llm.generate` over NATS, usage counts,
n, stop strings, logprobs, errors before and during a stream, 64 concurrent streams, and a
disconnect that frees the request's blocks."""

import asyncio
import json

import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpager.services.client import Client

from tests.services.http_fixture import nats_client, nats_text, served  # noqa: F401
from tests.services.test_fuzz import bad_limits, bad_values, broken_bodies, valid_requests

PROMPT = "The paged cache"
MESSAGES = [{"role": "user", "content": "Hello there"}]


async def test_models_and_health(served, api, tiny_llama):  # noqa: F811
    models = (await api.models.list()).data
    assert [m.id for m in models] == [tiny_llama.name]
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{served.base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_equals_nats(api, model, nats_client: Client, stream):  # noqa: F811
    want, usage = await nats_text(nats_client, prompt=PROMPT, max_tokens=20, temperature=0.0)
    fields = dict(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    if stream:
        chunks = [c async for c in await api.completions.create(**fields, stream=True)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        done = await api.completions.create(**fields)
        text, finish = done.choices[0].text, done.choices[0].finish_reason
        assert done.usage.prompt_tokens == usage.num_prompt_tokens
        assert done.usage.completion_tokens == usage.num_completion_tokens == 20
        assert done.usage.total_tokens == usage.num_prompt_tokens + 20
    assert text == want and finish == "length"


async def test_chat_whole_and_streamed_with_usage(api, model, nats_client):  # noqa: F811
    want, usage = await nats_text(nats_client, messages=MESSAGES, max_tokens=16, temperature=0.0)
    fields = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    whole = await api.chat.completions.create(**fields)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == usage.num_prompt_tokens
    stream = await api.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_max_completion_tokens_and_default(api, model):
    done = await api.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=3, temperature=0
    )
    assert done.usage.completion_tokens <= 3
    done = await api.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 16  # OpenAI's default for completions


async def test_n_samples_with_a_seed(api, model, nats_client):  # noqa: F811
    fields = dict(model=model, n=2, max_tokens=12, temperature=1.0, seed=7)
    done = await api.chat.completions.create(messages=MESSAGES, **fields)
    assert sorted(choice.index for choice in done.choices) == [0, 1]
    again = await api.chat.completions.create(messages=MESSAGES, **fields)
    assert [c.message.content for c in again.choices] == [c.message.content for c in done.choices]
    total = sum(len(c.message.content) > 0 for c in done.choices)
    assert total == 2 and done.usage.completion_tokens > 2
    one = await api.chat.completions.create(messages=MESSAGES, **{**fields, "n": 1})
    assert done.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    stream = await api.completions.create(prompt=PROMPT, stream=True, **fields)
    texts = ["", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(texts)


async def test_batched_prompts(api, model, nats_client):  # noqa: F811
    prompts = [PROMPT, "Another prompt"]
    done = await api.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    assert [choice.index for choice in done.choices] == [0, 1]
    for prompt, choice in zip(prompts, done.choices):
        want, _ = await nats_text(nats_client, prompt=prompt, max_tokens=6, temperature=0.0)
        assert choice.text == want


async def test_stop_string(api, model, nats_client):  # noqa: F811
    want, _ = await nats_text(nats_client, prompt=PROMPT, max_tokens=30, temperature=0.0)
    stop = want[8:11]
    assert stop.strip(), want
    done = await api.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop]
    )
    choice = done.choices[0]
    assert choice.text == want[: want.index(stop)] and choice.finish_reason == "stop"


async def test_logprobs(api, model):
    chat = await api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"skip_special_tokens": False},  # the token texts keep them too
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0.0
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)  # greedy: the best
        assert token.bytes == list(token.token.encode())
    assert "".join(token.token for token in content) == chat.choices[0].message.content
    done = await api.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    stream = await api.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, stream=True
    )
    offsets = [
        o async for c in stream if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == logprobs.text_offset  # offsets into the whole text, chunk after chunk


async def test_errors_are_openai_error_objects(api, model):
    with pytest.raises(openai.NotFoundError) as caught:
        await api.completions.create(model="no-such-model", prompt=PROMPT)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:  # refused by the tokenizer's caps
        await api.completions.create(model=model, prompt=PROMPT, max_tokens=901, stream=True)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        await api.completions.create(model=model, prompt=[1, "x"])
    assert caught.value.body["param"] == "prompt"


# --- raw server-sent events ---------------------------------------------------------------------


async def _sse_lines(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


async def test_raw_sse_ends_with_done(served, model):  # noqa: F811
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", f"{served.api_url}/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = await _sse_lines(response)
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


async def test_error_mid_stream_is_an_error_event(served, model, nats_client):  # noqa: F811
    """A deadline passing mid-stream: an SSE error event, then [DONE]; the blocks are freed."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "stream": True}
    body |= {"ignore_eos": True, "timeout": 1.0}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{served.api_url}/completions", json=body) as response:
            assert response.status_code == 200
            lines = await _sse_lines(response)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
    assert len(lines) > 3, lines  # tokens came before the error


async def test_deadline_before_the_first_token_is_504(served, model):  # noqa: F811
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{served.api_url}/completions", json=body | {"timeout": 0.5})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"


async def test_64_concurrent_streams(served, model, nats_client):  # noqa: F811
    prompts = [f"{PROMPT} {i % 4}" for i in range(64)]
    wants = {
        p: (await nats_text(nats_client, prompt=p, max_tokens=8, temperature=0.0))[0]
        for p in set(prompts)
    }

    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}
        body["temperature"] = 0
        async with http.stream("POST", f"{served.api_url}/completions", json=body) as response:
            assert response.status_code == 200
            lines = await _sse_lines(response)
        assert lines[-1] == "data: [DONE]"
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        texts = await asyncio.gather(*(one(http, prompt) for prompt in prompts))
    assert texts == [wants[prompt] for prompt in prompts]


async def test_disconnect_mid_stream_frees_blocks(served, model, nats_client):  # noqa: F811
    body = {"model": model, "prompt": PROMPT * 8, "max_tokens": 900, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    aborted = (await nats_client.stats()).num_finished.get("abort", 0)
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{served.api_url}/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(6):
                await anext(lines)
            assert (await nats_client.stats()).num_used_blocks > 0
        # leaving the block closes the connection mid-stream
    for _ in range(100):
        stats = await nats_client.stats()
        if stats.num_finished.get("abort", 0) > aborted and stats.num_used_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert stats.num_finished.get("abort", 0) == aborted + 1, stats
    assert stats.num_used_blocks == 0 and stats.num_running == 0, stats


async def test_disconnect_from_a_whole_response_aborts_quietly(served, model, nats_client):  # noqa: F811
    """A client leaving a non-streamed request: the request is aborted, its blocks freed, and
    the gateway logs no traceback (an InvalidStateError from a future set twice)."""
    body = {"model": model, "prompt": PROMPT * 8, "max_tokens": 900, "ignore_eos": True}
    aborted = (await nats_client.stats()).num_finished.get("abort", 0)
    err = served.log_dir / "err.txt"
    logged = len(served.output()), len(err.read_text())
    async with httpx.AsyncClient(timeout=60) as http:
        request = asyncio.ensure_future(http.post(f"{served.api_url}/completions", json=body))
        for _ in range(200):
            if (await nats_client.stats()).num_used_blocks > 0:
                break
            await asyncio.sleep(0.02)
        request.cancel()  # closes its connection
        with pytest.raises(asyncio.CancelledError):
            await request
    for _ in range(100):
        stats = await nats_client.stats()
        if stats.num_finished.get("abort", 0) > aborted and stats.num_used_blocks == 0:
            break
        await asyncio.sleep(0.05)
    assert stats.num_finished.get("abort", 0) == aborted + 1, stats
    assert stats.num_used_blocks == 0 and stats.num_running == 0, stats
    await asyncio.sleep(0.5)  # the gateway's clean-up, logged after the abort
    output = served.output()[logged[0] :] + err.read_text()[logged[1] :]
    assert "Traceback" not in output and "InvalidStateError" not in output, output


# --- bad input ----------------------------------------------------------------------------------


def _openai_body(request: dict) -> tuple[str, dict]:
    """A fuzz case's NATS request as an OpenAI one: its endpoint and body."""
    body = {"model": "tiny-llama0", **request}
    if "prompt_token_ids" in body:
        body["prompt"] = body.pop("prompt_token_ids")
    return ("chat/completions" if "messages" in body else "completions"), body


def _bad(request: dict) -> bool:
    """Bad over NATS, and over HTTP too: 65 tokens are within this kvpager's cap, and a null
    (msgspec writes infinity so) is OpenAI's way of asking for the default."""
    return request.get("max_tokens") != 65 and None not in request.values()


bad_requests = st.one_of(
    bad_values().map(lambda case: msgspec.json.decode(case.body) if not case.msgpack else None),
    st.builds(lambda r, kv: {**r, kv[0]: kv[1]}, valid_requests, bad_limits),
).filter(lambda request: isinstance(request, dict) and _bad(request))
bad_bodies = broken_bodies().filter(lambda case: not case.msgpack).map(lambda case: case.body)


def test_fuzzed_bad_input_gets_one_4xx_each(served, model):  # noqa: F811
    seen: dict[int, int] = {}

    @settings(
        max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.one_of(bad_requests.map(_openai_body), bad_bodies.map(lambda b: ("completions", b))))
    def check(case) -> None:
        path, body = case
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        response = httpx.post(
            f"{served.api_url}/{path}", content=content, headers=headers, timeout=60
        )
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
        seen[response.status_code] = seen.get(response.status_code, 0) + 1

    check()
    assert seen.get(400, 0) > 100, seen
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
    assert httpx.post(f"{served.api_url}/completions", json=body).status_code == 200
