"""Structured outputs and tool calls through `kvpager serve --http-port` with the openai
client, on a tiny random model: whatever its weights prefer, the grammar decides the shape.
Every test ends with all KV blocks free (the `nats_client` fixture)."""

import json
import re
from typing import Literal

import openai
import pydantic
import pytest

from tests.services.http_fixture import gateway, nats_client, served  # noqa: F401

MESSAGES = [{"role": "user", "content": "Describe a small fox."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "size", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


class Fox(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    size: Literal["small", "large"]
    count: int = pydantic.Field(ge=0, le=9)


def _check(value: dict) -> None:
    assert set(value) == {"name", "size", "count"}, value
    assert len(value["name"]) <= 6 and value["size"] in ("small", "large")
    assert 0 <= value["count"] <= 9


async def test_eight_answers_match_a_strict_json_schema(api, model, nats_client):  # noqa: F811
    form = {"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}}
    choices = []
    for seed in (1, 2):  # the test stack allows n <= 4
        done = await api.chat.completions.create(
            model=model, messages=MESSAGES, n=4, temperature=1.0, seed=seed, max_tokens=100,
            response_format=form,
        )  # fmt: skip
        choices += done.choices
    assert len(choices) == 8
    for choice in choices:
        assert choice.finish_reason == "stop"
        _check(json.loads(choice.message.content))


async def test_parse_with_a_pydantic_model(api, model, nats_client):  # noqa: F811
    done = await api.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Fox, max_tokens=100, temperature=1.0
    )
    fox = done.choices[0].message.parsed
    assert isinstance(fox, Fox)
    _check(fox.model_dump())


async def test_choice_regex_and_json_object(api, model, nats_client):  # noqa: F811
    choices = ["red", "green", "blue jay"]
    done = await api.completions.create(
        model=model, prompt="A colour:", n=4, temperature=1.0, max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in done.choices)
    done = await api.completions.create(
        model=model,
        prompt="A code:",
        max_tokens=20,
        extra_body={"guided_regex": "[a-f]{2}-[0-9]{3}"},
    )
    assert re.fullmatch("[a-f]{2}-[0-9]{3}", done.choices[0].text)
    stream = await api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=300, temperature=0.0, stream=True,
        response_format={"type": "json_object"},
    )  # fmt: skip
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":  # a random model may write a long object
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "intege"}}}
        }}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ],
)  # fmt: skip
async def test_bad_spec_is_a_400_naming_the_field(api, model, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra)
    assert caught.value.body["param"] in (param, "guided_regex"), caught.value.body


@pytest.mark.parametrize("stream", [False, True])
async def test_named_tool_choice(api, model, nats_client, stream):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = await _tool_calls(api, model, stream, tools=[WEATHER, CLOCK], tool_choice=named)
    assert [name for name, _ in calls] == ["get_weather"]
    arguments = json.loads(calls[0][1])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("stream", [False, True])
async def test_required_tool_choice(api, model, nats_client, stream):  # noqa: F811
    calls = await _tool_calls(api, model, stream, tools=[WEATHER, CLOCK], tool_choice="required")
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    for name, arguments in calls:
        assert isinstance(json.loads(arguments), dict), (name, arguments)


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=3)


class Trip(pydantic.BaseModel):
    start: Place
    end: Place


async def test_required_tool_choice_with_nested_models(api, model, nats_client):  # noqa: F811
    """Nested Pydantic models put `$defs` and `$ref`s in the parameters: the forced array
    still compiles, and every call's arguments validate against the model."""
    parameters = Trip.model_json_schema()
    assert "$defs" in parameters
    trip = {"type": "function", "function": {"name": "plan_trip", "parameters": parameters}}
    fields = dict(tools=[trip, CLOCK], tool_choice="required", parallel_tool_calls=False)
    calls = await _tool_calls(api, model, False, **fields)
    assert calls and all(name in ("plan_trip", "get_time") for name, _ in calls)
    for name, arguments in calls:
        if name == "plan_trip":
            Trip.model_validate_json(arguments)


async def _tool_calls(api, model, stream: bool, **fields) -> list[tuple[str, str]]:
    """(name, arguments) of each call, from a whole answer or reassembled from deltas."""
    common = dict(model=model, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=3)
    if not stream:
        done = await api.chat.completions.create(**common, **fields)
        choice = done.choices[0]
        want = "stop" if isinstance(fields.get("tool_choice"), dict) else "tool_calls"
        assert choice.finish_reason == want
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    calls: dict[int, list[str]] = {}
    finish = None
    async for chunk in await api.chat.completions.create(**common, **fields, stream=True):
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            if call.id is not None:  # a call's first delta: id, type and name
                assert call.index not in calls and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                calls[call.index][1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "tool_calls")
    return [tuple(calls[i]) for i in sorted(calls)]


async def test_tool_turns_go_through_the_template(api, model, nats_client):  # noqa: F811
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 4}'},
    ]  # fmt: skip
    done = await api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert done.choices[0].message.tool_calls is None and done.usage.completion_tokens > 0


async def test_auto_needs_the_flags(api, model):
    with pytest.raises(openai.BadRequestError) as caught:
        await api.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER])
    assert caught.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in caught.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_parses_hermes_calls(served, tiny_llama, tmp_path, nats_client, stream):  # noqa: F811
    """With vLLM's flags, `auto` parses the hermes calls the model writes (forced here with a
    regex, since a random model would not write one)."""
    flags = {"KVPAGER_ENABLE_AUTO_TOOL_CHOICE": "true", "KVPAGER_TOOL_CALL_PARSER": "hermes"}
    hermes = (
        r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    )
    fields = dict(tools=[WEATHER, CLOCK], extra_body={"guided_regex": hermes})
    with gateway(served, tiny_llama, tmp_path, **flags) as own:
        client = openai.AsyncOpenAI(base_url=own.api_url, api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        calls = await _tool_calls(client, model, stream, **fields)
        await client.close()
    assert len(calls) == 1 and calls[0][0] == "get_time"
    assert json.loads(calls[0][1])["zone"] in ("UTC", "CET")


async def test_over_nats_a_bad_spec_is_an_error_event(nats_client):  # noqa: F811
    """Past the gateway, the tokenizer service refuses it (naming the field) before the
    scheduler; a good one is honoured."""
    events = [
        event
        async for event in nats_client.generate(
            prompt="hi", structured_outputs={"regex": "a(b"}, max_tokens=4
        )
    ]
    assert events[-1].error.param == "structured_outputs.regex", events[-1]
    text = ""
    async for event in nats_client.generate(
        prompt="hi", structured_outputs={"choice": ["alpha", "beta"]}, max_tokens=8
    ):
        text += event.text
    assert text in ("alpha", "beta")
