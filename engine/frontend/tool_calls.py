"""Tool calls in generated text, and the grammars that force them (vLLM's way).

- `auto`: the model decides; calls come in the hermes format that Qwen and SmolLM use,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed from the text
  (`parse_hermes`) or from a stream as it grows (`HermesStream`), like vLLM's
  `--tool-call-parser hermes`.
- `required`: the output is forced (structured outputs) to a JSON array of
  `{"name": one of the tools, "parameters": its schema}` (`required_schema`).
- named: the output is forced to that function's parameters schema: the text is the arguments.
"""

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _call_of(text: str) -> ParsedCall | None:
    """One hermes call body, or None if it is not `{"name": str, "arguments": ...}`."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole answer. As vLLM's parser: the content is the text before
    the first call (None if blank); a call that does not parse leaves the text all content."""
    stream = HermesStream()
    pieces = stream.feed(text) + stream.finish()
    if stream.failed:
        return text, []
    calls = [piece for piece in pieces if isinstance(piece, ParsedCall)]
    if not calls:
        return text, []
    content = text.split(OPEN, 1)[0]
    return (content if content.strip() else None), calls


class HermesStream:
    """Text in, pieces out: content strings, and each call once its `</tool_call>` (or the end
    of the answer) has come. Text that may be the start of a tag is held back."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.failed = False  # a call body that did not parse (its text went out as content)

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._buffer += text
        pieces: list[str | ParsedCall] = []
        while True:
            tag = CLOSE if self._in_call else OPEN
            at = self._buffer.find(tag)
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(tag) :]
            pieces += self._close(before) if self._in_call else [before]
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_tag(self._buffer)
            pieces.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
        return [piece for piece in pieces if piece != ""]

    def finish(self) -> list[str | ParsedCall]:
        """The rest: an unclosed call is parsed as it stands (a model may stop before `</`)."""
        rest, self._buffer = self._buffer, ""
        pieces = self._close(rest) if self._in_call else [rest]
        self._in_call = False
        return [piece for piece in pieces if piece != ""]

    def _close(self, body: str) -> list[str | ParsedCall]:
        call = _call_of(body.strip())
        if call is None:
            self.failed = True
            return [OPEN + body]
        return [call]


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def parse_required(text: str) -> list[ParsedCall]:
    """The calls of an answer forced by `required_schema` (a JSON array)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    return [
        ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in value
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none given: any object."""
    return function.get("parameters") or ANY_OBJECT


def required_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """At least one call (exactly one unless `parallel`), each to one of `functions` with
    parameters matching its schema (vLLM's schema for tool_choice "required").

    Each function's parameters move under the root's `$defs` (as `tool<i>`), their local
    `$ref`s rewritten to match: a `#/$defs/Address` of nested Pydantic models names the
    parameters' own `$defs`, which would not exist at the root of the array schema."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": {"$ref": f"#/$defs/tool{i}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, function in enumerate(functions)
    ]
    defs = {
        f"tool{i}": _rooted(parameters_schema(f), f"#/$defs/tool{i}")
        for i, f in enumerate(functions)
    }
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": variants},
        "$defs": defs,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rooted(node: Any, root: str) -> Any:
    """`node` with each local `$ref` ("#", "#/...") made relative to `root` instead."""
    if isinstance(node, list):
        return [_rooted(item, root) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        else:
            out[key] = _rooted(value, root)
    return out
