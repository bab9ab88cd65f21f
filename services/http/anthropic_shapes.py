"""kvpager's answers in Anthropic's Messages shapes: errors, usage, stop reasons, content
blocks, and the blocks' stream events made from the chat path's OpenAI-style deltas
(services/http/tool_output.py), so that text and tool calls are parsed once, for both APIs.
"""

import json
import uuid
from typing import Any

from kvpager.schemas.public import Usage

ERROR_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; 5xx other than 503 are api_error."""
    kind = ERROR_TYPE_OF_STATUS.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def usage(found: Usage | None, num_prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's convention: `input_tokens` counts the prompt tokens neither read from the
    cache nor written into a pinned prefix; the three add up to the prompt."""
    if found is None:
        return _usage(num_prompt_tokens, 0, 0, 0)
    read, written = found.num_cached_prompt_tokens, found.num_cache_write_tokens
    uncached = max(0, found.num_prompt_tokens - read - written)
    return _usage(uncached, found.num_completion_tokens, written, read)


def _usage(uncached: int, output: int, written: int, read: int) -> dict[str, int]:
    return {
        "input_tokens": uncached,
        "output_tokens": output,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def stop_reason(finish_reason: str | None, matched: Any, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; `called`: it has tool calls."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_id(openai_id: str) -> str:
    return "toolu_" + openai_id.removeprefix("call_")


def content(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The blocks of a whole answer, from the chat path's assistant message."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = _arguments(function["arguments"])
        if arguments is None:  # cut short (max_tokens): the text as it came
            blocks.append({"type": "text", "text": function["arguments"]})
            continue
        block = {"type": "tool_use", "id": tool_id(call["id"]), "name": function["name"]}
        blocks.append({**block, "input": arguments})
    return blocks


def _arguments(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class BlockEvents:
    """content_block_start / _delta / _stop events from OpenAI-style deltas: text pieces
    (`{"content": ...}`) and tool calls (a head with id and name, then argument fragments)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.num_calls = 0

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        text = delta.get("content")
        if text:
            if self.kind != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                self.num_calls += 1
                head = {"type": "tool_use", "id": tool_id(call["id"]), "input": {}}
                events += self._start({**head, "name": call["function"]["name"]})
            fragment = call.get("function", {}).get("arguments")
            if fragment:
                events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": self.index,
            "delta": delta,
        }
