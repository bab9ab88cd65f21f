"""A Responses API request onto a chat completion request, so that it takes the chat route's
one path (services/http/requests.py: checks, tools, structured outputs, the GenerateRequest).

The conversation is chat turns: an earlier response's turns (`previous_response_id`, from the
store) and then this request's `input` items. `instructions` become the first, system turn;
as at OpenAI they are not carried over from the earlier response. Function call items become an
assistant turn's `tool_calls`, their outputs tool turns. `developer` is the system role.
"""

from typing import Any

import msgspec
from kvpager.schemas.openai import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from kvpager.schemas.openai_responses import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    NamedFunctionChoice,
    ResponsesRequest,
)
from kvpager.services.http.errors import HttpError

_ITEM_TYPES = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
# the chat request's names of the fields, as the Responses API names them (errors name these)
PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "prompt": "input",  # the tokenizer's and the scheduler's name for it
}


def input_messages(request: ResponsesRequest) -> list[Message]:
    """This request's `input` as chat turns (without the instructions)."""
    if isinstance(request.input, str):
        return [Message(role="user", content=request.input)]
    if not request.input:
        raise HttpError.invalid("input: must not be empty", "input")
    turns: list[Message] = []
    for i, raw in enumerate(request.input):
        _add_item(turns, _item(raw, f"input[{i}]"))
    return turns


def chat_request(request: ResponsesRequest, history: list[Message]) -> ChatCompletionRequest:
    """The chat request that answers `request`, after the earlier turns `history`."""
    _check_served(request)
    messages = list(history) + input_messages(request)
    if request.instructions is not None:
        messages.insert(0, Message(role="system", content=request.instructions))
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        stream=request.stream,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        response_format=_response_format(request),
        tools=_tools(request.tools),
        tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
    )


def renamed(error: HttpError) -> HttpError:
    """A chat route's error, naming the Responses API's field."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    head, _, index = head.partition("[")
    if head not in PARAM_NAMES:
        return error
    param = PARAM_NAMES[head] + (f"[{index}" if index else "") + dot + rest
    message = error.message.replace(head, PARAM_NAMES[head], 1)
    return HttpError(error.status, message, error.code, param)


def _check_served(request: ResponsesRequest) -> None:
    if request.background:
        message = "background: not served (every response is answered in its request)"
        raise HttpError.invalid(message, "background")
    metadata = request.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise HttpError.invalid(f"metadata: at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            message = (
                f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters, values of at "
                f"most {MAX_METADATA_VALUE_CHARS}"
            )
            raise HttpError.invalid(message, "metadata")


def _item(raw: dict[str, Any], param: str) -> Any:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if kind not in _ITEM_TYPES:
        message = f"{param}.type: {kind!r} is not served (message, function_call, "
        message += "function_call_output)"
        raise HttpError.invalid(message, f"{param}.type")
    try:
        return msgspec.convert(raw, _ITEM_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise HttpError.invalid(f"{param}: {exc}", param) from exc


def _add_item(turns: list[Message], item: Any) -> None:
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        turns.append(Message(role=role, content=_text(item.content)))
    elif isinstance(item, FunctionCallItem):
        call = ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant":  # the same answer's text or calls
            last.tool_calls = (last.tool_calls or []) + [call]
        else:
            turns.append(Message(role="assistant", content=None, tool_calls=[call]))
    else:
        turns.append(Message(role="tool", content=item.output, tool_call_id=item.call_id))


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    form = request.text.format if request.text is not None else None
    if form is None:
        return None
    if form.type != "json_schema":
        return ResponseFormat(type=form.type)
    if form.schema is None:
        raise HttpError.invalid("text.format: json_schema needs schema", "text.format")
    named = JsonSchemaFormat(form.name or "response", form.schema, form.strict, form.description)
    return ResponseFormat(type="json_schema", json_schema=named)


def _tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            message = f"tools[{i}].type: {kind!r} is not served (function tools only)"
            raise HttpError.invalid(message, f"tools[{i}].type")
        try:
            tool = msgspec.convert(raw, FunctionTool)
        except msgspec.ValidationError as exc:
            raise HttpError.invalid(f"tools[{i}]: {exc}", f"tools[{i}]") from exc
        function = FunctionDefinition(tool.name, tool.description, tool.parameters, tool.strict)
        out.append(Tool(type="function", function=function))
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(choice.name))
    return choice
