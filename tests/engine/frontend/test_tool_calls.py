"""The hermes tool-call parser on text as Qwen2.5 and SmolLM write it, whole and streamed."""

import json

import pytest
from kvpager.engine.frontend.tool_calls import (
    HermesStream,
    ParsedCall,
    parse_hermes,
    parse_required,
    required_schema,
)

# Qwen2.5-7B-Instruct's answer to "weather in Paris and Tokyo?" with a get_weather tool
QWEN = (
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n'
    "</tool_call>"
)
WITH_CONTENT = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "search", "arguments": {"query": "paged attention"}}\n</tool_call>'
)


def test_two_calls() -> None:
    content, calls = parse_hermes(QWEN)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Tokyo", "unit": "celsius"}


def test_content_before_a_call_and_plain_text() -> None:
    content, calls = parse_hermes(WITH_CONTENT)
    assert content == "Let me look that up.\n"
    assert calls == [ParsedCall("search", '{"query": "paged attention"}')]
    assert parse_hermes("Just text, 3 < 4.") == ("Just text, 3 < 4.", [])


def test_broken_call_stays_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {</tool_call>'
    assert parse_hermes(text) == (text, [])


def test_unclosed_last_call_is_parsed() -> None:
    _, calls = parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert calls == [ParsedCall("f", '{"x": 1}')]


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_stream_in_any_fragments_gives_the_same(size: int) -> None:
    stream = HermesStream()
    pieces = []
    for start in range(0, len(WITH_CONTENT), size):
        pieces += stream.feed(WITH_CONTENT[start : start + size])
    pieces += stream.finish()
    text = "".join(p for p in pieces if isinstance(p, str))
    assert text == "Let me look that up.\n"
    assert [p for p in pieces if isinstance(p, ParsedCall)] == parse_hermes(WITH_CONTENT)[1]
    assert all("<" not in p for p in pieces if isinstance(p, str))  # no tag leaks as content


def test_required_answers() -> None:
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert parse_required(text) == [ParsedCall("f", '{"a": 1}'), ParsedCall("g", "{}")]
    schema = required_schema([{"name": "f"}], parallel=False)
    assert schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["f"]}


def test_tools_and_tool_turns_reach_the_chat_template(tiny_llama) -> None:
    """The tools and an assistant turn's calls are what the template renders (a hermes-style
    template, as Qwen2.5's writes them)."""
    from kvpager.engine.frontend.inputs import InputProcessor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
        "{% endfor %}|{% endfor %}"
    )
    inputs = InputProcessor(tokenizer, 384)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = tokenizer.decode(inputs.chat_ids(messages, add_generation_prompt=False, tools=tools))
    assert text.startswith("<tools>f;</tools>user:go|assistant:")
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text
    assert text.endswith("tool:42|")
