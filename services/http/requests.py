"""OpenAI requests onto kvpager's `GenerateRequest`s: one per prompt, each with `n` samples.

Everything is checked here that can be without the model: types, ranges (by msgspec, against
GenerateRequest's own constraints) and OpenAI's rules; what needs the tokenizer (prompt length,
the service's caps) comes back as an error event from the tokenizer.
"""

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import structlog
from kvpager.engine.structured.limits import DEFAULT_LIMITS, GrammarLimits
from kvpager.schemas.openai import (
    IGNORED,
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    SamplingFields,
)
from kvpager.schemas.public import GenerateRequest
from kvpager.schemas.sampling import MAX_LOGIT_BIAS
from kvpager.services.http import decoding
from kvpager.services.http.decoding import param_of
from kvpager.services.http.errors import HttpError
from kvpager.services.http.structured import (
    ToolMode,
    ToolSettings,
    structured_spec,
    template_tool_calls,
    tool_definitions,
    tool_mode,
)

log = structlog.get_logger(__name__)

Kind = Literal["chat", "completion"]
MAX_PROMPTS = 256  # prompts in one completion request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
PASSED = (  # same name and meaning in both APIs; None: the engine's default
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "timeout",
    "priority",
)
NO_AUTO_TOOLS = ToolSettings()
_TYPES = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


@dataclass(frozen=True)
class Job:
    """One HTTP request: what goes over NATS, and how the answer is to be shaped."""

    kind: Kind
    response_id: str
    created: int
    model: str  # as the client named it
    requests: list[GenerateRequest]  # one per prompt
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (vLLM's continuous_usage_stats)
    top_logprobs: int | None  # None: no logprobs
    tool_mode: ToolMode | None = None  # chat with tools: how the answer becomes tool calls
    echo: bool = False  # completions: the prompt precedes each choice's text and logprobs
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt alone (one token dropped)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field in the response
    # (the client's field, the spec) of a structured request: compiled before it is sent
    structured: tuple[str, dict[str, Any]] | None = None

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index


def decode(
    body: bytes, kind: Kind, allow_unknown: bool = False
) -> ChatCompletionRequest | CompletionRequest:
    return decoding.decode(body, _TYPES[kind], allow_unknown)


def build_job(
    request: Any,
    kind: Kind,
    request_id: str | None,
    max_tokens: int,
    key_salt: str | None = None,
    tools: ToolSettings = NO_AUTO_TOOLS,
    grammar_limits: GrammarLimits = DEFAULT_LIMITS,
) -> Job:
    """`max_tokens`: the default when the request gives none; `key_salt`: the API key's
    prefix-cache salt (services/http/guard.py), None without keys; `tools`: the gateway's
    tool-calling flags; `grammar_limits`: the sizes a structured spec may have."""
    base_id = request_id or uuid.uuid4().hex
    fields = _sampling(request, kind, max_tokens)
    prompt_options = _prompt_options(request, kind, fields)
    salt = cache_salt(key_salt, request.cache_salt)
    if salt is not None:
        fields["cache_salt"] = salt
    mode, tool_spec = tool_mode(request, tools) if kind == "chat" else (None, None)
    structured = structured_spec(request, tool_spec, grammar_limits)
    if structured is not None:
        fields["structured_outputs"] = structured[1]
    prompts = _chat_prompt(request) if kind == "chat" else _completion_prompts(request)
    requests = [
        _generate_request({**fields, **prompt, "request_id": f"{base_id}-{i}"}, request, kind)
        for i, prompt in enumerate(prompts)
    ]
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    options = request.stream_options
    if options is not None and not request.stream:
        raise HttpError.invalid("stream_options: only with stream: true", "stream_options")
    _check_unserved(request)
    include_usage = options is not None and options.include_usage
    return Job(
        kind=kind,
        response_id=f"{prefix}-{base_id}",
        created=int(time.time()),
        model=request.model,
        requests=requests,
        n=request.n,
        stream=request.stream,
        include_usage=include_usage,
        continuous_usage=include_usage and options.continuous_usage_stats,
        top_logprobs=_top_logprobs(request, kind),
        tool_mode=mode,
        structured=structured,
        **prompt_options,
    )


def cache_salt(key_salt: str | None, given: str | None) -> str | None:
    """The request's prefix-cache salt: the key's, then the client's own within it, so that a
    client's chosen salt can never reach another key's cache entries."""
    parts = [part for part in (key_salt, given) if part is not None]
    return ":".join(parts) if parts else None


def _check_unserved(request: SamplingFields) -> None:
    """Note what kvpager ignores."""
    ignored = [name for name in IGNORED if getattr(request, name) is not None]
    if ignored:
        log.debug("fields ignored", fields=ignored)


def _sampling(request: SamplingFields, kind: Kind, default_max_tokens: int) -> dict[str, Any]:
    fields = {name: getattr(request, name) for name in PASSED}
    fields = {name: value for name, value in fields.items() if value is not None}
    max_tokens = request.max_tokens
    if kind == "chat" and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    fields["stream"] = request.stream
    if request.logit_bias is not None:
        fields["logit_bias"] = _logit_bias(request.logit_bias)
    top = _top_logprobs(request, kind)
    if top is not None:
        fields["logprobs"] = top
    return fields


def _logit_bias(given: dict[str, float]) -> dict[int, float]:
    """OpenAI's keys are token ids as text; the ranges are checked as a GenerateRequest's."""
    for key, bias in given.items():
        if not (key.isascii() and key.isdigit()):
            raise HttpError.invalid(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
            message = f"logit_bias: {key}: {bias} is not in [-100, 100]"
            raise HttpError.invalid(message, "logit_bias")
    return {int(key): bias for key, bias in given.items()}


def _prompt_options(request: Any, kind: Kind, fields: dict[str, Any]) -> dict[str, bool]:
    """Echo and prompt logprobs, onto `fields`, as vLLM has them: with echo and logprobs, the
    prompt's logprobs are computed with as many alternatives; `max_tokens: 0` with echo asks
    for the prompt alone (one token is generated and dropped: its prefill is the work)."""
    echo = kind == "completion" and request.echo
    if request.prompt_logprobs is not None:
        if request.stream:
            message = "prompt_logprobs: not available with stream: true (vLLM's rule)"
            raise HttpError.invalid(message, "prompt_logprobs")
        fields["prompt_logprobs"] = request.prompt_logprobs
    elif echo and request.logprobs is not None:
        fields["prompt_logprobs"] = request.logprobs
    prompt_only = echo and fields["max_tokens"] == 0
    if prompt_only:
        fields["max_tokens"] = 1
    if echo:
        fields["echo"] = True
    return {
        "echo": echo,
        "prompt_only": prompt_only,
        "prompt_logprobs": "prompt_logprobs" in fields,
    }


def _top_logprobs(request: Any, kind: Kind) -> int | None:
    if kind == "completion":
        return request.logprobs
    if request.top_logprobs is not None and not request.logprobs:
        raise HttpError.invalid("top_logprobs: needs logprobs: true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def _generate_request(fields: dict[str, Any], request: Any, kind: Kind) -> GenerateRequest:
    """Checked against GenerateRequest's constraints; errors name the OpenAI field."""
    try:
        return msgspec.convert(fields, GenerateRequest)
    except msgspec.ValidationError as exc:
        param = param_of(str(exc))
        message = str(exc)
        if kind == "chat" and param == "logprobs":
            param, message = "top_logprobs", message.replace("`$.logprobs`", "`$.top_logprobs`")
        if kind == "chat" and param == "max_tokens" and request.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise HttpError.invalid(message, param) from exc


def _chat_prompt(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    prompt: dict[str, Any] = {"messages": chat_messages(request.messages)}
    # tool_choice none: no tool list in the prompt (vLLM's --exclude-tools-when-tool-choice-none),
    # so that a model told not to call is not shown how to; earlier calls and results stay
    tools = None if request.tool_choice == "none" else tool_definitions(request)
    if tools is not None:
        prompt["tools"] = tools
    return [prompt]


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI's messages as kvpager's: role and text, and a tool turn's or an assistant
    turn's tool fields for the template."""
    if not messages:
        raise HttpError.invalid("messages: must not be empty", "messages")
    out = []
    for i, message in enumerate(messages):
        turn: dict[str, Any] = {
            "role": message.role,
            "content": _text(message.content, f"messages[{i}].content"),
        }
        if message.tool_calls:
            turn["tool_calls"] = template_tool_calls(message.tool_calls)
        for name in ("tool_call_id", "name"):
            if getattr(message, name) is not None:
                turn[name] = getattr(message, name)
        out.append(turn)
    return out


def _text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise HttpError.invalid(f"{param}: only text parts are served", param)
        parts.append(part.text)
    return "".join(parts)


def _completion_prompts(request: CompletionRequest) -> list[dict[str, Any]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise HttpError.invalid("prompt: must not be empty", "prompt")
    if all(isinstance(item, int) for item in prompt):
        return [{"prompt_token_ids": prompt}]
    if len(prompt) > MAX_PROMPTS:
        raise HttpError.invalid(f"prompt: at most {MAX_PROMPTS} prompts a request", "prompt")
    if all(isinstance(item, str) for item in prompt):
        return [{"prompt": item} for item in prompt]
    if all(isinstance(item, list) for item in prompt):
        return [{"prompt_token_ids": item} for item in prompt]
    message = "prompt: a string, a list of strings, of token ids, or of token id lists"
    raise HttpError.invalid(message, "prompt")
