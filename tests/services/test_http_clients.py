"""What real clients send (the openai SDK, browsers, proxies), through a `kvpager http` with
API keys, an allowed origin and auto tool choice, in front of the `served` stack: the
developer role, logit_bias and its bounds, a CORS preflight before the key check, X-Request-Id
echoed, and tool_choice auto with a template that ignores tools (the tiny model's ChatML, as
SmolLM2's): the tools go into the system turn. Every test ends with all KV blocks free."""

import json

import httpx
import openai
import pytest

from tests.services.http_fixture import gateway, nats_client, served  # noqa: F401

KEY = "key-clients"
ORIGIN = "https://app.kvpager.test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ENV = {
    "KVPAGER_API_KEY": KEY,
    "KVPAGER_ALLOWED_ORIGINS": ORIGIN,
    "KVPAGER_ENABLE_AUTO_TOOL_CHOICE": "true",
    "KVPAGER_TOOL_CALL_PARSER": "hermes",
}


@pytest.fixture(scope="module")
def front(served, tiny_llama, tmp_path_factory):  # noqa: F811
    with gateway(served, tiny_llama, tmp_path_factory.mktemp("clients"), **ENV) as found:
        yield found


@pytest.fixture
async def client(front):
    async with openai.AsyncOpenAI(base_url=front.api_url, api_key=KEY, max_retries=0) as api:
        yield api


async def test_developer_is_the_system_role(client, tiny_llama, nats_client):  # noqa: F811
    async def answer(role: str):
        messages = [{"role": role, "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
        return await client.chat.completions.create(
            model=tiny_llama.name, messages=messages, max_tokens=6, temperature=0.0
        )

    developer, system = await answer("developer"), await answer("system")
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


async def test_logit_bias_forces_a_token(client, front, tiny_llama, nats_client):  # noqa: F811
    forced = 42
    done = await client.completions.create(
        model=tiny_llama.name, prompt="The paged cache", max_tokens=4, temperature=0.0,
        logit_bias={str(forced): 100},
    )  # fmt: skip
    text = httpx.post(f"{front.base_url}/detokenize", json={"tokens": [forced]}, headers=AUTH)
    assert done.choices[0].text == text.json()["prompt"] * 4
    free = await client.completions.create(
        model=tiny_llama.name, prompt="The paged cache", max_tokens=4, temperature=0.0
    )
    assert free.choices[0].text != done.choices[0].text
    chat = await client.chat.completions.create(
        model=tiny_llama.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0.0, logit_bias={str(forced): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == text.json()["prompt"] * 3


@pytest.mark.parametrize(
    "bias, found",
    [
        ({str(i): 1 for i in range(301)}, "over this server's limit (300)"),
        ({"100000": 5}, "token ids must be in [0, "),
        ({"12": 101}, "12: 101.0 is not in [-100, 100]"),
        ({"twelve": 1}, "'twelve' is not a token id"),
    ],
)
async def test_bad_logit_bias_is_a_400(client, tiny_llama, bias, found):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model=tiny_llama.name, prompt="Hi", max_tokens=1, logit_bias=bias
        )
    assert caught.value.body["param"] == "logit_bias", caught.value.body
    assert found in caught.value.body["message"]


async def test_priority_is_served_and_bounded(client, tiny_llama, nats_client):  # noqa: F811
    """vLLM's `priority` (docs/user/prompt-cache.md) goes through to llm.generate's."""
    urgent = await client.chat.completions.create(
        model=tiny_llama.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0.0, extra_body={"priority": -10},
    )  # fmt: skip
    plain = await client.chat.completions.create(
        model=tiny_llama.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0.0,
    )  # fmt: skip
    assert urgent.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model=tiny_llama.name, prompt="Hi", max_tokens=1, extra_body={"priority": 2**40}
        )
    assert "priority" in str(caught.value.body), caught.value.body


def test_a_preflight_from_an_allowed_origin_needs_no_key(front):
    ask = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    preflight = httpx.options(f"{front.api_url}/chat/completions", headers=ask)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(
        f"{front.api_url}/chat/completions", headers={**ask, "Origin": "https://evil.test"}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    keyless = httpx.get(f"{front.api_url}/models", headers={"Origin": ORIGIN})
    assert keyless.status_code == 401  # the preflight only: the request itself needs the key
    models = httpx.get(f"{front.api_url}/models", headers={"Origin": ORIGIN, **AUTH})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN


async def test_x_request_id_is_echoed(front, tiny_llama, nats_client):  # noqa: F811
    body = {"model": tiny_llama.name, "prompt": "Hi", "max_tokens": 1}
    headers = {**AUTH, "X-Request-Id": "trace-42.a:b"}
    done = httpx.post(f"{front.api_url}/completions", json=body, headers=headers)
    assert done.status_code == 200 and done.headers["x-request-id"] == "trace-42.a:b"
    assert done.json()["id"] == "cmpl-trace-42.a:b"
    refused = httpx.post(f"{front.api_url}/completions", json=body, headers={"X-Request-Id": "t-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "t-1"
    bad = httpx.post(
        f"{front.api_url}/completions", json=body, headers={**AUTH, "X-Request-Id": "a b"}
    )
    assert bad.status_code == 400 and "x-request-id" not in bad.headers
    with httpx.stream("POST", f"{front.api_url}/completions", json={**body, "stream": True},
                      headers={**headers, "X-Request-Id": "s-1"}) as sse:  # fmt: skip
        assert sse.headers["x-request-id"] == "s-1"
        assert any(line == "data: [DONE]" for line in sse.iter_lines())


async def test_auto_tools_go_into_the_prompt(client, front, tiny_llama, nats_client):  # noqa: F811
    messages = [{"role": "user", "content": "What time is it?"}]
    fields = dict(model=tiny_llama.name, messages=messages, max_tokens=4, temperature=0.0)
    plain = await client.chat.completions.create(**fields)
    auto = await client.chat.completions.create(**fields, tools=[CLOCK], tool_choice="auto")
    schema = {"prompt": json.dumps(CLOCK), "add_special_tokens": False}
    tool_tokens = httpx.post(f"{front.base_url}/tokenize", json=schema, headers=AUTH).json()
    # the tool list and its instructions came on top of the conversation: never dropped
    assert auto.usage.prompt_tokens - plain.usage.prompt_tokens > tool_tokens["count"] + 20
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"messages": messages, "tools": [CLOCK]}
    rendered = httpx.post(f"{front.base_url}/tokenize", json=body, headers=AUTH).json()
    assert rendered["count"] == auto.usage.prompt_tokens
    tokens = {"tokens": rendered["tokens"]}
    text = httpx.post(f"{front.base_url}/detokenize", json=tokens, headers=AUTH).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(CLOCK) in text
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
