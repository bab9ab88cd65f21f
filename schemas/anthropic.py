"""What the HTTP gateway receives on `POST /v1/messages`: Anthropic's Messages API request.

The fields the anthropic SDK sends for text and tool use. Content blocks are one struct with
a `type` tag rather than a tagged union, so that an unserved block type (image, document,
thinking) gets a 400 that names it instead of a decoding error. The SDK of 2026 (2.x) sends
no `temperature`, `top_p` or `top_k` of its own; they are served for clients that do (and
through the SDK's `extra_body`). Unknown fields are an error,
as on the OpenAI routes, unless the gateway runs with `--allow-unknown-fields`.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class CacheControl(msgspec.Struct, forbid_unknown_fields=True):
    """`{"type": "ephemeral", "ttl": "5m" | "1h"}`: the cached prefix ends at this block."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ToolResultText(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class ContentBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A block of a message or of the system prompt; served: text, tool_use, tool_result."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ToolResultText] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # text blocks the SDK sends back as it got them


class AnthropicMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMetadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages`."""

    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: AnthropicMetadata | None = None
    stream: bool = False
    cache_control: Annotated[
        CacheControl | None,
        Meta(description="automatic caching: the marker of the last block (the whole prompt)"),
    ] = None
    service_tier: str | None = None  # accepted, ignored: one tier here
    thinking: (
        Annotated[dict[str, Any], Meta(description='only {"type": "disabled"} is served')] | None
    ) = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/messages/count_tokens`: a Messages request's prompt, without generation."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
