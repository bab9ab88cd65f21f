"""What clients send and receive: the public API, JSON on the wire (msgpack on request).

`llm.generate` takes a `GenerateRequest` (JSON, or msgpack with the header
`Content-Type: application/msgpack`) published with a reply subject; the events come back on
it as `GenerateEvent`s, in the request's encoding. While a stream has nothing to say, a
keepalive comes every second or so: an empty message with the header `Kvpager-Keepalive`;
skip it (a stream silent for much longer has lost its tokenizer). `llm.abort` takes an
`AbortRequest`; `llm.health`, `llm.stats` and `llm.models` answer any (empty) request with
`Health`, `Stats` and `ModelList`; `llm.tokenize` and `llm.detokenize` answer a
`TokenizeRequest` / `DetokenizeRequest` with a `TokenizeResult` / `DetokenizeResult`.
`kvpager schema` prints the JSON Schema of these structs.
"""

from typing import Annotated, Literal

import msgspec
from kvpager.schemas.errors import ErrorType
from kvpager.schemas.public_requests import (  # noqa: F401 (the public API's names, here too)
    INT32_MAX,
    AbortRequest,
    ChatMessage,
    Count,
    DetokenizeRequest,
    GenerateRequest,
    NonNegInt,
    Penalty,
    PromptCache,
    TokenizeRequest,
)
from msgspec import Meta

FinishReason = Literal["stop", "length", "abort", "error"]
# `seq` of the final event `kvpager serve` sends for a stream whose tokenizer died: serve
# cannot know how many events went before it (its error type is "unavailable")
ORPHANED_SEQ = -1


class ErrorInfo(msgspec.Struct):
    """Why a request failed; `param` names the offending request field when there is one.

    `type` (schemas/errors.py's ErrorType): invalid_request, request_too_long, overloaded (the
    waiting queue is full; retry later), unavailable (no scheduler answers, or a service lost
    its NATS connection), executor_unavailable (the executor stopped, hung or restarted; retry
    once it is back), model_not_found (no instance serves the requested `model`),
    migration_failed (the stream's instance failed more than `--migration-limit` times),
    deadline_exceeded, internal_error, invalid_config, invalid_checkpoint, invalid_step (an
    internal step refused), and connection_lost: made by the Python client itself when its
    NATS connection dropped or the stream went silent (events may be lost; the client aborted
    the request).
    """

    type: ErrorType
    message: str
    param: str | None = None


class TokenizeResult(msgspec.Struct):
    token_ids: list[int] = []
    error: ErrorInfo | None = None


class DetokenizeResult(msgspec.Struct):
    text: str = ""
    error: ErrorInfo | None = None


class Usage(msgspec.Struct):
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_prompt_tokens: Annotated[int, Meta(description="served by the prefix cache")]
    num_cache_write_tokens: Annotated[
        int, Meta(description="prompt tokens newly written into a pinned prefix (`cache`)")
    ] = 0
    cached_tokens_by_tier: Annotated[
        dict[str, int], Meta(description="num_cached_prompt_tokens by tier: device, cpu, disk")
    ] = {}


TokenText = Annotated[str, Meta(description="the token decoded alone, special tokens kept")]


class TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    token: TokenText | None = None
    top_tokens: Annotated[list[str], Meta(description="top_token_ids' texts")] | None = None


class PromptLogprob(msgspec.Struct):
    """One prompt token (from the second on) under the model, given the tokens before it."""

    token_id: int
    logprob: float
    rank: Annotated[int, Meta(description="1: the model's most likely token")]
    top_token_ids: list[int]
    top_logprobs: list[float]
    token: TokenText | None = None
    top_tokens: Annotated[list[str], Meta(description="top_token_ids' texts")] | None = None


class GenerateEvent(msgspec.Struct, kw_only=True):
    """One event of a stream. `seq` counts 0, 1, 2... per stream, so a gap is visible.

    Each of the request's `n` samples (`index`) ends with exactly one final event, the one
    with `usage` set; it has a `finish_reason` and, when the sample failed, `error`. Its usage
    is the request's so far, as vLLM's continuous usage stats: the prompt's tokens once, and
    the completion tokens of all the samples up to then; so the last final event of a stream
    has the request's total (OpenAI's usage for n > 1), and a consumer keeps the latest usage
    rather than adding them up. The stream ends once all `n` samples have had their final
    event, except for a request refused before its stream began: that gets one event, `seq` 0
    with `error` set and no `num_prompt_tokens` (which a begun stream's first event has),
    whatever `n`. With `stream: false` a sample's final event carries
    all its text and token ids, and is its only event except when a long prompt's
    `prompt_logprobs` do not fit one message: they then come over several events (in order,
    `finish_reason` unset but on the last), to be joined.
    """

    request_id: str
    seq: int
    index: Annotated[int, Meta(description="which of the n samples")] = 0
    text: Annotated[str, Meta(description="new text since the previous event")] = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: Annotated[
        int | str | None, Meta(description="the stop token id or stop string that matched")
    ] = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_score: Annotated[
        float | None,
        Meta(description="beam search: the beam's length-penalised log-probability"),
    ] = None
    abort_token: Annotated[
        str | None,
        Meta(description="first event of a request sent without one: what llm.abort needs"),
    ] = None
    num_prompt_tokens: (
        Annotated[int, Meta(description="on a stream's first event: the prompt's length")] | None
    ) = None
    prompt_token_ids: (
        Annotated[list[int], Meta(description="with echo, on a stream's first event")] | None
    ) = None
    prompt_text: (
        Annotated[str, Meta(description="with echo, on a stream's first event: the prompt as text")]
        | None
    ) = None
    prompt_tokens: (
        Annotated[list[str], Meta(description="with echo: prompt_token_ids' texts, one a token")]
        | None
    ) = None
    prompt_logprobs: (
        Annotated[
            list[PromptLogprob | None],
            Meta(
                description="with prompt_logprobs: one per prompt token, null for the first; "
                "a long prompt's over several events, to be joined in order"
            ),
        ]
        | None
    ) = None

    @property
    def is_final(self) -> bool:
        """The last event of its sample (`index`): the stream ends after all `n` of them."""
        return self.usage is not None

    @property
    def is_orphaned(self) -> bool:
        """The final event serve sends when the stream's tokenizer died (seq ORPHANED_SEQ)."""
        return self.seq == ORPHANED_SEQ and self.is_final


class Health(msgspec.Struct):
    """`ok` when a tokenizer, the scheduler and its executor all answer."""

    status: Literal["ok", "unavailable"]
    instance: str
    model: str
    message: str = ""


class ModelCard(msgspec.Struct):
    id: str
    instance: str
    max_model_len: int
    vocab_size: int


class ModelList(msgspec.Struct):
    models: list[ModelCard]


class Percentiles(msgspec.Struct):
    """Of the most recent samples (milliseconds)."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


class Histogram(msgspec.Struct):
    """Every sample of one latency since start (seconds), in Prometheus's cumulative form:
    `counts[i]` samples were at most `bounds[i]`; `count` is all of them (the +Inf bucket)."""

    bounds: list[float] = []
    counts: list[int] = []
    count: int = 0
    sum: Annotated[float, Meta(description="of every sample, seconds")] = 0.0


class Stats(msgspec.Struct, kw_only=True):
    """One scheduler/executor pair: KV blocks, queues, throughput and latencies."""

    instance: str
    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: Annotated[int, Meta(description="free blocks holding prefix-cache data")]
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swap_preemptions: Annotated[
        int, Meta(description="preemptions that moved blocks to host memory")
    ] = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    num_cpu_blocks: Annotated[int, Meta(description="host-memory pool for swapped blocks")] = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_evictions: Annotated[int, Meta(description="cached blocks moved to the CPU pool")] = 0
    num_block_copies: Annotated[int, Meta(description="copy-on-write copies")] = 0
    num_disk_blocks: Annotated[int, Meta(description="prefix blocks known on the disk tier")] = 0
    num_disk_stored_blocks: Annotated[
        int, Meta(description="blocks written to the disk tier as they left the CPU pool")
    ] = 0
    num_disk_loaded_blocks: Annotated[
        int, Meta(description="blocks read back from the disk tier into the CPU pool")
    ] = 0
    num_disk_failed_loads: Annotated[
        int, Meta(description="disk reads that missed: vanished, torn or corrupt files")
    ] = 0
    num_disk_prefetched_blocks: Annotated[
        int, Meta(description="disk reads issued while their request was still queued")
    ] = 0
    num_disk_prefetch_dropped_blocks: Annotated[
        int,
        Meta(
            description="disk reads (early or at the turn) that did not become their request's"
            " hits: a failed read before them, the request left, or evicted and read again"
        ),
    ] = 0
    num_disk_rejected_files: Annotated[
        int, Meta(description="disk-tier files that failed their MAC (forged or altered): deleted")
    ] = 0
    num_pinned_blocks: Annotated[
        int, Meta(description="device blocks pinned by requests' `cache`, in use or not")
    ] = 0
    num_pinned_evictions: Annotated[
        int, Meta(description="pinned blocks evicted under pressure (demoted, or dropped)")
    ] = 0
    kv_transfer_blocks: Annotated[
        int, Meta(description="KV blocks that arrived from another instance (drain migration)")
    ] = 0
    kv_transfer_bytes: Annotated[int, Meta(description="their bytes")] = 0
    kv_transfer_mean_ms: Annotated[float, Meta(description="mean time of one transfer")] = 0.0
    kv_transfer_failed: Annotated[
        int, Meta(description="transfers that failed: their requests recomputed")
    ] = 0
    kv_handoffs: Annotated[
        int, Meta(description="streams handed on with their blocks, read by the next instance")
    ] = 0
    state_snapshot_hits: Annotated[
        int, Meta(description="recurrent models: prefix hits resumed from a state snapshot")
    ] = 0
    state_snapshot_hit_tokens: Annotated[int, Meta(description="the tokens they skipped")] = 0
    num_state_snapshots: Annotated[
        int, Meta(description="state snapshots held, one per cached block boundary")
    ] = 0
    state_snapshot_bytes: Annotated[int, Meta(description="their bytes on the executor")] = 0
    num_host_state_snapshots: Annotated[
        int, Meta(description="state snapshots of blocks on the CPU or disk tier, in host memory")
    ] = 0
    host_state_snapshot_bytes: Annotated[int, Meta(description="their bytes in host memory")] = 0
    host_state_snapshot_hits: Annotated[
        int, Meta(description="prefix hits resumed from a snapshot in host memory")
    ] = 0
    num_state_slots: Annotated[
        int, Meta(description="recurrent models: per-sequence state slots, out of the KV budget")
    ] = 0
    num_free_state_slots: Annotated[int, Meta(description="of them, held by no sequence")] = 0
    num_state_snapshot_slots: Annotated[
        int, Meta(description="state rows for prefix snapshots, out of the KV budget")
    ] = 0
    state_slot_bytes: Annotated[int, Meta(description="one state row's bytes")] = 0
    num_steps: int
    num_finished: Annotated[dict[str, int], Meta(description="per finish reason")]
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    num_generated_tokens: int
    num_prompt_tokens: Annotated[int, Meta(description="of requests once first scheduled")] = 0
    tokens_per_s: Annotated[float, Meta(description="generated, over the last 10 s")]
    ttft_ms: Annotated[Percentiles, Meta(description="arrival at the scheduler to 1st token")]
    itl_ms: Annotated[Percentiles, Meta(description="between tokens of one request")]
    step_ms: Annotated[Percentiles, Meta(description="executor time per step")]
    executor_wait_ms: Annotated[
        Percentiles, Meta(description="executor idle between back-to-back steps")
    ]
    spec_decode_num_drafts: Annotated[
        int, Meta(description="speculative decoding: sequences whose proposals a step verified")
    ] = 0
    spec_decode_num_draft_tokens: Annotated[int, Meta(description="proposed tokens verified")] = 0
    spec_decode_num_accepted_tokens: Annotated[
        int, Meta(description="proposed tokens accepted (rate: / num_draft_tokens)")
    ] = 0
    ttft_s: Annotated[Histogram, Meta(description="as ttft_ms")] = msgspec.field(
        default_factory=Histogram
    )
    itl_s: Annotated[Histogram, Meta(description="as itl_ms")] = msgspec.field(
        default_factory=Histogram
    )
    e2e_s: Annotated[
        Histogram, Meta(description="arrival at the scheduler to the last sample's end")
    ] = msgspec.field(default_factory=Histogram)
    queue_s: Annotated[
        Histogram, Meta(description="arrival at the scheduler to first scheduled")
    ] = msgspec.field(default_factory=Histogram)
