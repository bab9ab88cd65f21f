"""What a tokenizer replica receives from its scheduler (msgpack).

`AddResult` answers an AddRequest. `TokenBatch` arrives on the replica's own subject
(`<prefix>.internal.<instance>.tokens.<replica>`), one per step with every delta of the
streams that replica owns, in step order. An empty message with a reply subject on that
subject is the scheduler's liveness ping: the replica answers with an empty message.
"""

import msgspec
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import PromptLogprobs, TokenLogprobs


class AddResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """None: queued. Otherwise why the scheduler refused the request (too long, overloaded).

    `scheduler_id` names the scheduler that queued it: if another one answers later, the
    request is lost.
    """

    error: ErrorInfo | None = None
    scheduler_id: str = ""


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New token ids of one sample; a set `finish_reason` is its last delta."""

    request_id: str
    index: int = 0
    token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (last delta)
    logprobs: list[TokenLogprobs] | None = None  # aligned with token_ids when asked for
    error: ErrorInfo | None = None  # with finish_reason "error"
    cumulative_score: float | None = None  # beam search: the beam's length-penalised score
    # the whole prompt's (start 1), once per request: with its first token delta
    prompt_logprobs: PromptLogprobs | None = None
    # (last delta) prompt tokens newly pinned (GenerateRequest.cache), and num_cached_tokens
    # by tier: "device", "cpu", "disk"
    num_cache_write_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = {}
    # a drained instance's final delta: the stream's blocks, held for the next instance
    kv_handoff: KvHandoff | None = None


class TokenBatch(msgspec.Struct, array_like=True):
    step_id: int
    deltas: list[SampleDelta]


# --- KV events and load: what every tokenizer's router hears from every scheduler, on
# `<prefix>.internal.<instance>.kv.events` (and the load, in the scheduler's $SRV.STATS).


class BlockStored(msgspec.Struct, tag="stored", array_like=True, omit_defaults=True):
    """A full block now cached under its chained hash (engine/kv/block_hash.py)."""

    block_hash: bytes
    parent_hash: bytes | None  # None: the first block of a prompt (or unknown, on disk)
    tier: str = "device"  # "device" | "disk" (a file the instance reads back through CPU)
    # a pinned prompt-cache block (GenerateRequest.cache): the unix time its pin ends. A block
    # already stored is announced again each time a request pins it (or extends its pin)
    pinned_until: float | None = None


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True, omit_defaults=True):
    """A cached block was evicted (its content is gone from the device, or from the disk)."""

    block_hash: bytes
    tier: str = "device"


class CacheCleared(msgspec.Struct, tag="cleared", array_like=True):
    """Nothing is cached any more (a new engine core, a new executor)."""


KvEvent = BlockStored | BlockRemoved | CacheCleared


class InstanceLoad(msgspec.Struct, kw_only=True):
    """One instance's model and load, as its scheduler last saw them."""

    model: str = ""  # "" until an executor attached
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 0
    # free device blocks that pins hold (GenerateRequest.cache): taken only after every other
    # free block, so they count as in use for the router's cost
    num_pinned_free_blocks: int = 0
    closing: bool = False  # refusing new requests (shutting down or drained)
    role: str = "both"  # prefill | decode | both (disaggregation: engine/router/routing.py)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


class KvEvents(msgspec.Struct, array_like=True):
    """KV events of one scheduler, numbered 0, 1, 2... per `scheduler_id`: a gap means lost
    events. `load` is the instance's load after them."""

    instance: str
    scheduler_id: str
    seq: int
    events: list[KvEvent]
    load: InstanceLoad
