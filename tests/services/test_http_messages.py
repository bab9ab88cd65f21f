"""`POST /v1/messages` with the anthropic SDK, unmodified, against `kvpager serve` on a tiny
random model: whole and streamed messages, tool use there and back, greedy answers equal to
the chat route's, cache_control as the GenerateRequest's `cache` (read off `llm.generate`),
x-api-key and Anthropic's error shape. Every test ends with all KV blocks free."""

import asyncio
import json

import anthropic
import httpx
import msgspec
import nats
import pytest
from kvpager.schemas.public import GenerateRequest
from kvpager.services import credentials
from kvpager.services.connection import flush_sent

from tests.services.http_fixture import gateway, nats_client, served  # noqa: F401

KEY = "key-messages"
GREEDY = {"temperature": 0.0}  # the anthropic SDK 2.x has no temperature argument of its own
SYSTEM = "You are a terse assistant that answers about foxes."
USER = "Describe a small fox."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def keyed(served, tiny_llama, tmp_path_factory):  # noqa: F811
    log_dir = tmp_path_factory.mktemp("messages")
    with gateway(served, tiny_llama, log_dir, KVPAGER_API_KEY=KEY) as found:
        yield found


@pytest.fixture
async def claude(served):  # noqa: F811
    """The anthropic client on the served gateway (no keys there)."""
    client = anthropic.AsyncAnthropic(base_url=served.base_url, api_key="unused", max_retries=0)
    yield client
    await client.close()


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_create_equals_the_chat_route_greedy(claude, api, tiny_llama, nats_client):  # noqa: F811
    message = await claude.messages.create(
        model=tiny_llama.name, system=SYSTEM, max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": USER}],
    )  # fmt: skip
    chat = await api.chat.completions.create(
        model=tiny_llama.name, max_tokens=12, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
    )  # fmt: skip
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == tiny_llama.name
    assert _text(message) == chat.choices[0].message.content
    want = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == want and message.stop_sequence is None
    assert message.usage.output_tokens == chat.usage.completion_tokens
    total = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert total + message.usage.cache_creation_input_tokens == chat.usage.prompt_tokens


async def test_streams_give_the_same_message(claude, tiny_llama, nats_client):  # noqa: F811
    fields = dict(
        model=tiny_llama.name, max_tokens=10, extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
    )  # fmt: skip
    whole = await claude.messages.create(**fields)
    async with claude.messages.stream(**fields) as stream:
        pieces = [text async for text in stream.text_stream]
        streamed = await stream.get_final_message()
    assert "".join(pieces) == _text(whole) == _text(streamed)
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    names = [event.type async for event in await claude.messages.create(**fields, stream=True)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    if _text(whole):
        assert names[1] == "content_block_start" and "content_block_delta" in names
        assert names[-3] == "content_block_stop"


async def test_stop_sequences_end_with_stop_sequence(claude, tiny_llama, nats_client):  # noqa: F811
    fields = dict(model=tiny_llama.name, max_tokens=12, extra_body=GREEDY, system=SYSTEM)
    messages = [{"role": "user", "content": USER}]
    free = await claude.messages.create(**fields, messages=messages)
    text = _text(free)
    assert len(text) > 3, text
    stop = text[2:4]
    stopped = await claude.messages.create(**fields, messages=messages, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert _text(stopped) == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_round_trip(claude, tiny_llama, nats_client, stream):  # noqa: F811
    fields = dict(model=tiny_llama.name, max_tokens=60, extra_body=GREEDY, tools=[WEATHER])
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    choice = {"type": "tool", "name": "get_weather"}
    if stream:
        async with claude.messages.stream(**fields, messages=ask, tool_choice=choice) as events:
            message = await events.get_final_message()
    else:
        message = await claude.messages.create(**fields, messages=ask, tool_choice=choice)
    assert message.stop_reason == "tool_use", message
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert set(call.input) == {"city", "unit"} and call.input["unit"] in ("celsius", "fahrenheit")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp": 4}'}
    turns = [*ask, {"role": "assistant", "content": message.content}]
    turns.append({"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]})
    answer = await claude.messages.create(  # no tools now: the test stack caps prompts at 400
        model=tiny_llama.name, max_tokens=8, extra_body=GREEDY, messages=turns
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens > 0
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 40
    forced = await claude.messages.create(**fields, messages=ask, tool_choice={"type": "any"})
    assert forced.stop_reason in ("tool_use", "max_tokens")


async def test_cache_control_reaches_the_engine_as_cache(claude, served, tiny_llama, nats_client):  # noqa: F811
    """The last marked block ends the pinned prefix; the system prompt is message 1."""
    seen: list[GenerateRequest] = []

    async def keep(msg) -> None:
        msgpack = "msgpack" in (msg.headers or {}).get("Content-Type", "")
        seen.append(
            (msgspec.msgpack if msgpack else msgspec.json).decode(msg.data, type=GenerateRequest)
        )

    # a client may not read llm.generate (services/credentials.py): a service identity may
    options = credentials.options_of(str(credentials.identity_path("service")))
    watcher = await nats.connect(served.nats_url, **options)
    subscription = await watcher.subscribe("llm.generate", cb=keep)
    await flush_sent(watcher)  # the server has the SUB (watcher.flush() does not promise it)
    hour = {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": SYSTEM, "cache_control": hour}]
    messages = [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "A fox."},
        {"role": "user", "content": [
            {"type": "text", "text": "More.", "cache_control": {"type": "ephemeral"}},
        ]},
    ]  # fmt: skip
    fields = dict(model=tiny_llama.name, max_tokens=2, extra_body=GREEDY)
    await claude.messages.create(**fields, system=system, messages=messages)
    await claude.messages.create(**fields, system=system, messages=messages[:1])
    tool = {"name": "t", "input_schema": {"type": "object"}, "cache_control": hour}
    hi = [{"role": "user", "content": "Hi"}]
    await claude.messages.create(**fields, messages=hi, tools=[tool],
                                 tool_choice={"type": "none"})  # fmt: skip
    await claude.messages.create(**fields, system=SYSTEM, messages=messages[:1])
    automatic = {"type": "ephemeral", "ttl": "1h"}
    await claude.messages.create(
        **fields, system=SYSTEM, messages=messages, cache_control=automatic
    )
    await asyncio.sleep(0.2)
    await subscription.unsubscribe()
    await watcher.close()
    caches = [None if r.cache is None else (r.cache.prefix_messages, r.cache.ttl) for r in seen]
    assert caches == [(4, 300.0), (1, 3600.0), (1, 3600.0), None, (4, 3600.0)], caches
    assert all(r.cache is None or r.cache.prefix_tokens is None for r in seen)


async def test_x_api_key_and_errors_in_anthropic_shape(keyed, tiny_llama, nats_client):  # noqa: F811
    fields = dict(model=tiny_llama.name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    async with anthropic.AsyncAnthropic(base_url=keyed.base_url, api_key=KEY, max_retries=0) as ok:
        done = await ok.messages.create(**fields)
        assert done.usage.output_tokens == 2
        with pytest.raises(anthropic.BadRequestError) as caught:
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": "AAAA"}}  # fmt: skip
            await ok.messages.create(
                **{**fields, "messages": [{"role": "user", "content": [image]}]}
            )
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0]" in caught.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError) as caught:
            await ok.messages.create(**{**fields, "model": "no-such-model"})
        assert caught.value.body["error"]["type"] == "not_found_error"
    async with anthropic.AsyncAnthropic(
        base_url=keyed.base_url, api_key="bad", max_retries=0
    ) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await bad.messages.create(**fields)
        assert caught.value.body["error"]["type"] == "authentication_error"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    no_max = {"model": tiny_llama.name, "messages": [{"role": "user", "content": "Hi"}]}
    refused = httpx.post(f"{keyed.base_url}/v1/messages", json=no_max, headers=headers)
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    bearer = {"Authorization": f"Bearer {KEY}"}
    body = {**no_max, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{keyed.base_url}/v1/messages", json=body, headers=bearer) as sse:
        lines = [line for line in sse.iter_lines() if line.startswith("event: ")]
    assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop"
    data = json.dumps({**body, "max_tokens": 0})
    zero = httpx.post(f"{keyed.base_url}/v1/messages", content=data, headers={**bearer,
                      "Content-Type": "application/json"})  # fmt: skip
    assert zero.status_code == 400 and zero.json()["error"]["type"] == "invalid_request_error"


async def test_count_tokens_counts_what_create_sends(claude, tiny_llama, nats_client):  # noqa: F811
    fields = dict(
        model=tiny_llama.name, system=SYSTEM, messages=[{"role": "user", "content": USER}]
    )
    counted = await claude.messages.count_tokens(**fields)
    done = await claude.messages.create(**fields, max_tokens=1)
    usage = done.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert counted.input_tokens == total
    tool = {"name": "t", "input_schema": {"type": "object"}}
    none = await claude.messages.count_tokens(**fields, tools=[tool], tool_choice={"type": "none"})
    assert none.input_tokens == total  # tool_choice none: no tool list in the prompt
    auto = await claude.messages.count_tokens(**fields, tools=[tool])
    assert auto.input_tokens > total + 40  # the template ignores tools: the fallback's list
