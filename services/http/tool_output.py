"""A chat answer's tool calls in OpenAI's shapes: the whole message, and streamed deltas.

Streamed calls follow OpenAI's delta shape: per call a first delta with its `index`, `id`,
`type` and function `name` (arguments ""), then argument fragments under the same `index`.
A named choice streams its arguments as the text comes; `auto` (hermes) sends each call once
its `</tool_call>` has come; `required` (one JSON array) sends its calls at the end.
"""

import uuid
from typing import Any

from kvpager.engine.frontend.tool_calls import (
    HermesStream,
    ParsedCall,
    parse_hermes,
    parse_required,
)
from kvpager.services.http.structured import ToolMode


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(call: ParsedCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": _call_id(), "type": "function", "function": function}


def message(mode: ToolMode, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, the choice's finish_reason) of a whole answer."""
    if mode.kind == "named":
        calls = [ParsedCall(mode.name or "", text)]
        content = None
    elif mode.kind == "required":
        content, calls = None, parse_required(text)
    else:
        content, calls = parse_hermes(text)
    body: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        body["tool_calls"] = [_call(call) for call in calls]
        # OpenAI: "tool_calls" when the model chose to call; a named choice ends "stop"
        if finish_reason == "stop" and mode.kind != "named":
            finish_reason = "tool_calls"
    return body, finish_reason


class ToolDeltas:
    """One choice's stream: each event's text in, its deltas out."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        self._hermes = HermesStream()
        self._text = ""  # required: the whole answer, parsed at the end

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        kind = self.mode.kind
        if kind == "named":
            return self._named(text)
        if kind == "required":
            self._text += text
            return self._calls(parse_required(self._text)) if final else []
        pieces = self._hermes.feed(text) + (self._hermes.finish() if final else [])
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                out += self._calls([piece])
            else:
                out.append({"content": piece})
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason == "stop" and self.num_calls and self.mode.kind != "named":
            return "tool_calls"
        return finish_reason

    def _named(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self.num_calls == 0:
            head = {"index": 0, "id": _call_id(), "type": "function"}
            head["function"] = {"name": self.mode.name, "arguments": ""}
            out.append({"tool_calls": [head]})
            self.num_calls = 1
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            index, self.num_calls = self.num_calls, self.num_calls + 1
            head = {"index": index, "id": _call_id(), "type": "function"}
            head["function"] = {"name": call.name, "arguments": ""}
            out.append({"tool_calls": [head]})
            fragment = {"index": index, "function": {"arguments": call.arguments}}
            out.append({"tool_calls": [fragment]})
        return out
