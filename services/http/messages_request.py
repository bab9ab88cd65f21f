"""Anthropic's Messages request onto the chat path: an OpenAI chat request built from it (so
that tools, tool_choice, sampling and their checks are the chat route's own), and the prompt
cache its `cache_control` marks asks for.

Mapping: the system prompt (text or text blocks) is the first message; a user turn's text
blocks are one user message and each `tool_result` a `tool` message (in their order); an
assistant turn's text and `tool_use` blocks one assistant message with its tool calls.
`tool_choice` auto / any / tool / none are OpenAI's auto / required / named / none.

`cache_control`: the last marked block (in Anthropic's order: tools, system, messages) ends
the pinned prefix: `cache.prefix_messages` counts the mapped messages up to and including the
one that block landed in (a marked tool or system block pins through the system turn, or the
first message when there is none), with that marker's TTL. A top-level `cache_control`
(automatic caching) marks the last block: the whole conversation.
"""

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kvpager.schemas.anthropic import (
    AnthropicMessage,
    AnthropicToolChoice,
    CacheControl,
    ContentBlock,
    MessagesRequest,
)
from kvpager.schemas.openai import ChatCompletionRequest
from kvpager.schemas.public_requests import PromptCache
from kvpager.services.http.errors import HttpError

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
TOOL_ERROR_PREFIX = "Error: "  # a tool_result with is_error: its text, so marked for the model


@dataclass
class _Conversation:
    """The mapped messages so far, and the last cache marker's (message count, TTL)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    marker: tuple[int, str] | None = None

    def mark(self, control: CacheControl | None, num_messages: int) -> None:
        if control is not None:
            self.marker = (max(1, num_messages), control.ttl)


def chat_request(request: MessagesRequest) -> tuple[ChatCompletionRequest, PromptCache | None]:
    """The OpenAI chat request of `request`, and its prompt cache (None: nothing marked)."""
    if request.max_tokens < 1:
        raise HttpError.invalid("max_tokens: must be at least 1", "max_tokens")
    conversation = _Conversation()
    for tool in request.tools or ():
        conversation.mark(tool.cache_control, 1)
    if request.system is not None:
        text = _system_text(request.system)
        conversation.messages.append({"role": "system", "content": text})
        for block in request.system if isinstance(request.system, list) else ():
            conversation.mark(block.cache_control, 1)
    if not request.messages:
        raise HttpError.invalid("messages: must not be empty", "messages")
    for i, message in enumerate(request.messages):
        _add_turn(conversation, message, f"messages[{i}]")
    conversation.mark(request.cache_control, len(conversation.messages))  # the last block
    thinking = (request.thinking or {}).get("type", "disabled")
    if thinking != "disabled":
        raise HttpError.invalid(f"thinking: {thinking!r} is not served", "thinking")
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": conversation.messages,
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.stop_sequences:
        fields["stop"] = request.stop_sequences
    fields.update(_tools(request))
    try:
        chat = msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise HttpError.invalid(str(exc), None) from exc
    return chat, _cache(conversation)


def _cache(conversation: _Conversation) -> PromptCache | None:
    if conversation.marker is None:
        return None
    num_messages, ttl = conversation.marker
    return PromptCache(ttl=TTL_SECONDS[ttl], prefix_messages=num_messages)


def _system_text(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    return "".join(_text_of(block, f"system[{i}]") for i, block in enumerate(system))


def _text_of(block: ContentBlock, param: str) -> str:
    if block.type != "text" or block.text is None:
        raise HttpError.invalid(f"{param}: a {block.type!r} block; expected text", param)
    return block.text


def _add_turn(conversation: _Conversation, message: AnthropicMessage, param: str) -> None:
    if isinstance(message.content, str):
        conversation.messages.append({"role": message.role, "content": message.content})
        return
    if message.role == "assistant":
        _add_assistant(conversation, message.content, param)
    else:
        _add_user(conversation, message.content, param)


def _add_user(conversation: _Conversation, blocks: list[ContentBlock], param: str) -> None:
    """Text blocks in a row become one user message; each tool_result a tool message."""
    messages = conversation.messages
    texts: list[str] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        if block.type == "tool_result":
            _flush_text(messages, texts)
            messages.append(_tool_message(block, where))
        else:
            texts.append(_text_of(block, where))
            if block.cache_control is not None:  # its text ends the message it is flushed into
                _flush_text(messages, texts)
        conversation.mark(block.cache_control, len(messages))
    _flush_text(messages, texts)


def _flush_text(messages: list[dict[str, Any]], texts: list[str]) -> None:
    if texts:
        messages.append({"role": "user", "content": "".join(texts)})
        texts.clear()


def _tool_message(block: ContentBlock, param: str) -> dict[str, Any]:
    if not block.tool_use_id:
        raise HttpError.invalid(f"{param}.tool_use_id: required", f"{param}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        content = "".join(
            _result_text(part, f"{param}.content[{k}]") for k, part in enumerate(content)
        )
    text = content or ""
    if block.is_error:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _result_text(part: Any, param: str) -> str:
    if part.type != "text" or part.text is None:
        raise HttpError.invalid(f"{param}: a {part.type!r} block; expected text", param)
    return part.text


def _add_assistant(conversation: _Conversation, blocks: list[ContentBlock], param: str) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        if block.type == "tool_use":
            calls.append(_tool_call(block, where))
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # the model's own reasoning sent back: not part of the prompt here
        else:
            texts.append(_text_of(block, where))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    conversation.messages.append(message)
    for block in blocks:
        conversation.mark(block.cache_control, len(conversation.messages))


def _tool_call(block: ContentBlock, param: str) -> dict[str, Any]:
    if not block.id or not block.name:
        raise HttpError.invalid(f"{param}: tool_use needs id and name", param)
    arguments = json.dumps(block.input or {}, ensure_ascii=False)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


def _tools(request: MessagesRequest) -> dict[str, Any]:
    """OpenAI's tools and tool_choice (and parallel_tool_calls) of the request's."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice.type != "none":
            raise HttpError.invalid("tool_choice: needs tools", "tool_choice")
        return {}
    tools = [
        {"type": "function", "function": _function(tool.name, tool.description, tool.input_schema)}
        for tool in request.tools
    ]
    fields: dict[str, Any] = {"tools": tools, "tool_choice": _tool_choice(choice)}
    if choice is not None and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _function(name: str, description: str | None, schema: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "parameters": schema}
    return function if description is None else {**function, "description": description}


def _tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None or choice.type == "auto":  # Anthropic's default with tools
        return "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise HttpError.invalid("tool_choice.name: required with type tool", "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}
