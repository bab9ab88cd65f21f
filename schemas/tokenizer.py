"""What a tokenizer replica receives from its scheduler (msgpack).

`AddResult` answers an AddRequest. `TokenBatch` arrives on the replica's own subject
(`<prefix>.internal.<instance>.tokens.<replica>`), one per step with every delta of the
streams that replica owns, in step order. An empty message with a reply subject on that
subject is the scheduler's liveness ping: the replica answers with an empty message.
"""

import msgspec

from schemas.public import ErrorInfo
from schemas.scheduler import TokenLogprobs


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


class TokenBatch(msgspec.Struct, array_like=True):
    step_id: int
    deltas: list[SampleDelta]
