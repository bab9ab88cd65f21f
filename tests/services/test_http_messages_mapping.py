"""Anthropic's Messages requests onto the chat path (services/http/messages_request.py), with
no services: the mapped messages, tools and tool_choice, and where `cache_control` ends the
pinned prefix."""

import msgspec
import pytest
from kvpager.schemas.anthropic import MessagesRequest
from kvpager.services.http.errors import HttpError
from kvpager.services.http.messages_request import chat_request

EPHEMERAL = {"type": "ephemeral"}
TOOL = {"name": "get_time", "input_schema": {"type": "object"}}


def _map(**fields):
    request = msgspec.convert({"model": "m", "max_tokens": 8, **fields}, MessagesRequest)
    chat, cache = chat_request(request)
    messages = [msgspec.to_builtins(m) for m in chat.messages]
    turns = [(m["role"], m.get("content")) for m in messages]
    return chat, turns, None if cache is None else (cache.prefix_messages, cache.ttl)


def test_turns_map_in_order():
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
              "content": [{"type": "text", "text": "no clock"}]}  # fmt: skip
    chat, turns, cache = _map(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, call]},
            {"role": "user", "content": [result, {"type": "text", "text": "Sorry"}]},
        ],
    )
    assert turns == [
        ("system", "AB"), ("user", "Hi"), ("assistant", "Let me see."),
        ("tool", "Error: no clock"), ("user", "Sorry"),
    ]  # fmt: skip
    (mapped,) = chat.messages[2].tool_calls
    assert mapped.id == "toolu_1" and mapped.function.name == "get_time"
    assert msgspec.json.decode(mapped.function.arguments) == {"zone": "UTC"}
    assert chat.messages[3].tool_call_id == "toolu_1" and cache is None


@pytest.mark.parametrize(
    "choice, openai",
    [(None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
     ({"type": "none"}, "none")],
)  # fmt: skip
def test_tool_choices(choice, openai):
    fields = {"tools": [TOOL], "messages": [{"role": "user", "content": "Hi"}]}
    if choice is not None:
        fields["tool_choice"] = choice
    chat, _, _ = _map(**fields)
    assert chat.tool_choice == openai and chat.tools[0].function.parameters == {"type": "object"}
    named, _, _ = _map(**{**fields, "tool_choice": {"type": "tool", "name": "get_time"}})
    assert named.tool_choice.function.name == "get_time"


def test_the_last_marker_ends_the_prefix():
    hour = {"type": "ephemeral", "ttl": "1h"}
    user = {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": EPHEMERAL}]}
    later = [{"role": "assistant", "content": "Yes"}, {"role": "user", "content": "More"}]
    _, _, cache = _map(system=[{"type": "text", "text": "S", "cache_control": hour}],
                       messages=[user, *later])  # fmt: skip
    assert cache == (2, 300.0)
    _, _, cache = _map(system="S", tools=[{**TOOL, "cache_control": hour}], messages=later[1:])
    assert cache == (1, 3600.0)
    _, _, cache = _map(tools=[{**TOOL, "cache_control": hour}], messages=later[1:])
    assert cache == (1, 3600.0)  # no system turn: through the first message
    _, _, cache = _map(system="S", messages=[*later[1:], *later], cache_control=hour)
    assert cache == (4, 3600.0)  # top level: the last block


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0]",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
    ],
)
def test_bad_requests_name_the_field(fields, param):
    with pytest.raises(HttpError) as caught:
        _map(**{"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert caught.value.status == 400 and caught.value.param == param
