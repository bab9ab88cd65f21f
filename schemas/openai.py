"""What the HTTP gateway receives: OpenAI's completion and chat completion requests.

The fields of OpenAI's API that kvpager serves, and vLLM's extras (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, ...), with OpenAI's names. Types are checked
here; ranges are checked once the request is mapped onto a `GenerateRequest` (the same checks
as over NATS). Unknown fields are an error, as at OpenAI, unless the gateway runs with
`--allow-unknown-fields` (vLLM's behaviour: logged and ignored). The fields that clients send by
default and that mean nothing to a local server (`IGNORED`) are accepted and ignored.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

IGNORED = ("metadata", "store", "service_tier", "user", "reasoning_effort")
# others could forge template turns; developer (OpenAI's newer system role) becomes system where
# the chat template has no developer turn (engine/frontend/inputs.py)
Role = Literal["system", "developer", "user", "assistant", "tool"]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: Annotated[bool, Meta(description="a last chunk with the usage")] = False
    continuous_usage_stats: Annotated[
        bool, Meta(description="vLLM's: with include_usage, usage in every chunk")
    ] = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    """`response_format.json_schema`: OpenAI's named schema (the openai client's `parse()`
    sends a Pydantic model's schema here, with `strict: true`)."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """`text`, `json_object` (any JSON object) or `json_schema` (that schema, enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """`{"type": "function", "function": {"name": ...}}`: call this one."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call in an earlier assistant turn, sent back with the conversation."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """One part of a message's content; only text parts are served."""

    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both requests share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: ResponseFormat | None = None
    logit_bias: (
        Annotated[dict[str, float], Meta(description="token id (as text) -> bias in [-100, 100]")]
        | None
    ) = None
    # OpenAI's fields that a local server has no use for: accepted, ignored (IGNORED)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Annotated[
        int,
        Meta(
            ge=-(2**31),
            le=2**31 - 1,
            description="vLLM's: lower is admitted first and evicted last (prompt-cache.md)",
        ),
    ] = 0
    cache_salt: (
        Annotated[str, Meta(min_length=1, max_length=128, description="prefix-cache scope")] | None
    ) = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: (
        Annotated[int, Meta(description="vLLM's: per prompt token, this many top alternatives")]
        | None
    ) = None
    # kvpager's own
    timeout: Annotated[float, Meta(description="seconds, then 504 (or an error event)")] | None = (
        None
    )


class CompletionRequest(SamplingFields, kw_only=True):
    """`POST /v1/completions`: a prompt, or a list of prompts (text or token ids)."""

    prompt: str | list[str | int | list[int]]
    logprobs: Annotated[int, Meta(description="top alternatives per token")] | None = None
    echo: Annotated[
        bool, Meta(description="the prompt precedes the completion, in its text and logprobs")
    ] = False


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: (
        Annotated[bool, Meta(description="default: true for a prompt, false for messages")] | None
    ) = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Meta(description="with messages, as chat's (vLLM's)")] | None = (
        None
    )


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /detokenize` (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[int]
