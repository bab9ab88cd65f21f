"""Request: one sequence's token state, as the scheduler and block manager see it."""

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputes its tokens when resumed
    SWAPPED = "swapped"  # blocks moved to the CPU pool; swapped back in when resumed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    """One sequence. `num_computed_tokens` chases `num_tokens`; a step that catches up samples.

    `num_tokens` counts prompt and output tokens; every token before `num_computed_tokens` has
    its K/V in the cache. Parallel samples and beams are separate Requests sharing blocks.
    """

    seq_id: str  # this sample's row: the client's request_id, or "<request_id>#<index>"
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # tokens being sampled by steps already planned but not yet answered (the scheduler plans
    # a step ahead of the executor): they count as tokens to schedule, not yet as known ones
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # speculative decoding: the executor's proposals after the last token, to verify next step
    spec_token_ids: list[int] = field(default_factory=list)
    # Parallel samples: every sample of a request shares `request_id` (the client's id, and
    # the parent's seq_id); `num_pending_forks` samples are forked from the parent when its
    # prompt completes.
    request_id: str = ""
    sample_index: int = 0
    num_pending_forks: int = 0
    priority: int = 0  # vLLM's: lower is admitted first, preempted and evicted last
    # GenerateRequest.cache, resolved by the input path: pin the full blocks of the first
    # `pin_tokens` prompt tokens for `pin_ttl` seconds (engine/kv/pins.py); set to 0 when the
    # request is over its pin quota, so it runs unpinned
    pin_tokens: int = 0
    pin_ttl: float = 0.0
    num_cache_write_tokens: int = 0  # prompt tokens this request newly pinned
    # num_cached_tokens by tier ("device", "cpu", "disk"), at first schedule
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_disk_hit_blocks: int = 0  # prompt blocks its admission read from the disk tier
    # a drained stream's continuation: its blocks come from another instance (kv_moves.py)
    kv_import: KvHandoff | None = None
    # the prefill half of a disaggregated pair: at its max_tokens its blocks stay held for the
    # decode side to read (KvMoves.hold_at_finish), not freed
    hold_kv: bool = False
    # a stream its prefill instance handed on that came back (no decode instance took it):
    # it finishes here, never handed on again (each bounce would compute one token)
    stays_here: bool = False

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.seq_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt + max_tokens)."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def check_stop(self) -> RequestStatus | None:
        """Finish status after a token was appended, or None to keep going.

        Stop *strings* are checked by the detokenizer, which finishes the request itself.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fork(self, seq_id: str, **changes) -> "Request":
        """A running copy sharing this request's tokens so far (parallel samples, beams)."""
        return dataclasses.replace(
            self,
            seq_id=seq_id,
            output_token_ids=list(self.output_token_ids),
            block_hashes=list(self.block_hashes),
            status=RequestStatus.RUNNING,
            num_pending_forks=0,
            num_preemptions=0,
            num_output_placeholders=0,
            spec_token_ids=[],
            **changes,
        )
