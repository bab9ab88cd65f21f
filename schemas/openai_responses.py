"""What the HTTP gateway receives on `POST /v1/responses`: OpenAI's Responses API request.

`input` is text or a list of items; the items are checked one by one (services/http/
responses_input.py) with the structs below, so that an error names `input[i]`. Types are checked
here; ranges once the request is mapped onto a chat request and a `GenerateRequest` (the same
checks as `/v1/chat/completions`). Unknown fields are an error, as on the other routes.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_METADATA_KEYS = 16  # OpenAI's bound, and its sizes below
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """A message's text: `input_text` (the client's) or `output_text` (an earlier answer's,
    sent back as the SDK's output items are)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(msgspec.Struct, forbid_unknown_fields=True):
    """`{"role", "content"}`, with `type: "message"` or without (the SDK's easy form)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True):
    """An earlier answer's call of a function tool."""

    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    arguments: str  # JSON text, as OpenAI sends it
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    """The Responses API's flat function tool (chat's has these under `function`)."""

    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    """`tool_choice: {"type": "function", "name": ...}`: call this one."""

    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    """`text.format`: `text`, `json_object`, or `json_schema` (the schema, enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses`."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # OpenAI's fields that a local server has no use for: accepted, ignored
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None  # only false: every response is answered in the request
