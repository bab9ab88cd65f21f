"""What clients send: the request structs of the public API (schemas/public.py tells the
subjects and re-exports these; `kvpager schema` prints them with the rest)."""

from typing import Annotated, Any

import msgspec
from kvpager.schemas.sampling import MAX_LOGIT_BIAS, MAX_NUM_LOGPROBS, StructuredOutputsParams
from msgspec import Meta

INT32_MAX = 2**31 - 1  # counts and token ids beyond this can never be served
NonNegInt = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One turn of a conversation, rendered with the model's chat template."""

    role: Annotated[str, Meta(min_length=1, description="e.g. system, user, assistant, tool")]
    content: Annotated[str, Meta(description='"" for an assistant turn of only tool_calls')]
    tool_calls: (
        Annotated[
            list[dict[str, Any]],
            Meta(description="an assistant turn's calls, OpenAI's shape, for the template"),
        ]
        | None
    ) = None
    tool_call_id: Annotated[str, Meta(description="a tool turn: the call it answers")] | None = None
    name: str | None = None


class PromptCache(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Keep a prompt prefix in the cache for a time: Anthropic's `cache_control` as a
    retention contract. The prefix's blocks are pinned for `ttl` seconds: evicted last,
    demoted to the CPU and disk tiers under pressure rather than dropped. At most one of
    `prefix_tokens` and `prefix_messages` is set; neither pins the whole prompt."""

    ttl: Annotated[
        float, Meta(gt=0.0, le=86400.0, description="seconds; Anthropic's 5m is 300, 1h 3600")
    ] = 300.0
    prefix_tokens: (
        Annotated[int, Meta(ge=1, le=INT32_MAX, description="pin the first N prompt tokens")] | None
    ) = None
    prefix_messages: (
        Annotated[
            int,
            Meta(ge=1, le=INT32_MAX, description="pin the rendered first N `messages`"),
        ]
        | None
    ) = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A generation request: exactly one of `prompt`, `messages` or `prompt_token_ids`.

    The sampling fields have the names, defaults and meanings of the engine's
    `SamplingParams` (vLLM's). Unknown fields are an error.
    """

    request_id: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=256,
                pattern="^[^#]+$",
                description="unique among requests in flight; no '#' (sample ids use it)",
            ),
        ]
        | None
    ) = None
    model: Annotated[str, Meta(description="served model name; none: any instance's")] | None = None
    abort_token: (
        Annotated[
            str,
            Meta(
                min_length=16,
                max_length=256,
                description="a secret that an llm.abort of this request must carry; none: "
                "the stream's first event brings one",
            ),
        ]
        | None
    ) = None
    cache_salt: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=256,
                description="prefix-cache entries are shared only among requests with the "
                "same salt (vLLM's); the HTTP gateway sets one per API key",
            ),
        ]
        | None
    ) = None
    cache: Annotated[PromptCache, Meta(description="pin the prompt's prefix")] | None = None
    priority: Annotated[
        int,
        Meta(
            ge=-(2**31),
            le=INT32_MAX,
            description="vLLM's: lower is admitted first and evicted last; ties by arrival",
        ),
    ] = 0
    prompt: Annotated[str, Meta(description="text, tokenized as is")] | None = None
    messages: (
        Annotated[
            list[ChatMessage], Meta(min_length=1, description="chat, rendered with its template")
        ]
        | None
    ) = None
    prompt_token_ids: (
        Annotated[list[NonNegInt], Meta(min_length=1, description="token ids, used as is")] | None
    ) = None
    tools: (
        Annotated[
            list[dict[str, Any]],
            Meta(description="with messages: OpenAI's tool definitions, for the chat template"),
        ]
        | None
    ) = None
    stream: Annotated[
        bool, Meta(description="an event per new tokens (true) or one final event (false)")
    ] = True
    timeout: (
        Annotated[float, Meta(gt=0, description="seconds from arrival, then aborted")] | None
    ) = None
    deadline: (
        Annotated[float, Meta(ge=0.0, description="unix time (seconds), then aborted")] | None
    ) = None
    n: Annotated[
        Count, Meta(description="samples per prompt, events tell them apart by `index`")
    ] = 1
    temperature: Annotated[float, Meta(ge=0.0, description="0 is greedy")] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX, description="0 or -1: disabled")] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    seed_offset: Annotated[
        int,
        Meta(
            ge=0,
            le=2**31 - 1,
            description="outputs an earlier run already sampled (the prompt ends with them): "
            "seeded draws go on from this output position",
        ),
    ] = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    max_tokens: Annotated[Count, Meta(description="most tokens to generate")] = 16
    min_tokens: Annotated[NonNegInt, Meta(description="no EOS or stop id before this")] = 0
    stop: Annotated[
        str | list[Annotated[str, Meta(min_length=1)]], Meta(description="stop strings")
    ] = []
    stop_token_ids: list[NonNegInt] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: (
        Annotated[
            int,
            Meta(
                ge=0, le=MAX_NUM_LOGPROBS, description="top alternatives besides the sampled token"
            ),
        ]
        | None
    ) = None
    prompt_logprobs: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_NUM_LOGPROBS,
                description="vLLM's: each prompt token's logprob and rank, and this many top "
                "alternatives, on the stream's first token event (the prompt skips the prefix "
                "cache: every position is computed)",
            ),
        ]
        | None
    ) = None
    echo: Annotated[
        bool, Meta(description="the stream's first event carries the prompt's token ids and text")
    ] = False
    skip_special_tokens: bool = True
    beam_width: Annotated[
        Count,
        Meta(description="beam search when > 1: the n best beams come whole, one final event each"),
    ] = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: Annotated[
        StructuredOutputsParams | None,
        Meta(description="constrain the output: a JSON schema, regex, choice or grammar"),
    ] = None
    logit_bias: (
        Annotated[
            dict[NonNegInt, Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Meta(
                description="OpenAI's: token id -> bias in [-100, 100] added to its logit; ids "
                "in the vocabulary, at most the server's --max-logit-bias entries"
            ),
        ]
        | None
    ) = None


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Stop a request: its stream ends with finish_reason "abort" and its blocks are freed.

    Honoured only with the request's `abort_token` (the one it was sent with, or the one its
    first event brought), which only the stream's owner knows."""

    request_id: str
    abort_token: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`llm.tokenize`: a prompt or a conversation to the token ids `llm.generate` would use."""

    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: (
        Annotated[bool, Meta(description="default: true for a prompt, false for messages")] | None
    ) = None
    add_generation_prompt: Annotated[bool, Meta(description="messages: end ready to reply")] = True
    tools: (
        Annotated[
            list[dict[str, Any]],
            Meta(description="with messages: OpenAI's tool definitions, as llm.generate's"),
        ]
        | None
    ) = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`llm.detokenize`: token ids to text, special tokens included."""

    token_ids: list[NonNegInt]
