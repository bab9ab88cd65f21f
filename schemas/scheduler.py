"""What the scheduler receives: sampled tokens from its executor, requests from tokenizers."""

import msgspec
from kvpager.schemas.kv_transfer import KvHandoff, KvPulled, KvSent
from kvpager.schemas.sampling import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float  # of the sampled token
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt tokens `start, start + 1, ...` (positions; `start` >= 1) under the model, each
    from the logits of the position before it: its logprob and rank (1: the most likely),
    and the request's `prompt_logprobs` top alternatives, best first."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprobs)


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sampled tokens of the requests whose computed tokens caught up this step."""

    step_id: int
    seq_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None  # aligned with seq_ids when any asked
    # Beam search: per beam, its best next tokens as (token id, log-prob), best first.
    beam_candidates: dict[str, list[tuple[int, float]]] = {}
    # Speculative decoding. A sequence whose proposed tokens were verified emits its
    # `sampled_token_ids` entry and then `extra_token_ids[seq_id]`, one per accepted proposal
    # (the last token emitted is always the model's own); `extra_logprobs` aligned with them.
    extra_token_ids: dict[str, list[int]] = {}
    extra_logprobs: dict[str, list[TokenLogprobs]] = {}
    # proposals for the next step, for the sequences the step asked (num_spec_tokens)
    draft_token_ids: dict[str, list[int]] = {}
    # The disk tier (engine/worker/disk/store.py): reads of earlier steps' `blocks_from_disk`
    # that finished (their CPU blocks now hold the content) or failed (a miss), by block hash;
    # blocks found on disk (the listing at start, in chunks, or another instance's files) and
    # gone from it (evicted by bytes, vanished); `disk_listed` once the listing is all sent.
    disk_loaded: list[bytes] = []
    disk_failed: list[bytes] = []
    disk_stored: list[bytes] = []
    disk_removed: list[bytes] = []
    disk_listed: bool = False
    disk_rejected: int = 0  # files that failed their MAC since the last step (deleted)
    # the prompt positions this step computed, for the sequences that asked (prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # sequences the executor could not constrain (grammar not compiled, matcher in error):
    # seq id -> why; each request ends alone with that error, this step's token dropped
    failed: dict[str, str] = {}

    def emitted_token_ids(self, idx: int) -> list[int]:
        """Every token row `idx`'s sequence emitted in this step, in order."""
        extra = self.extra_token_ids.get(self.seq_ids[idx], [])
        return [self.sampled_token_ids[idx], *extra]


# --- Over NATS: what the scheduler service receives -------------------------------------
# From tokenizers on `<prefix>.internal.<instance>.scheduler.requests`, in publish order, so a
# request's pieces always arrive before it: `PromptPiece`* then `AddRequest`, later maybe a
# `FinishRequest`.


class PromptPiece(msgspec.Struct, tag="piece", array_like=True):
    """Leading prompt ids of a request too long for one message; its AddRequest follows."""

    request_id: str
    token_ids: list[int]


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A tokenized request; `prompt_token_ids` follow the ids of its PromptPieces, if any.

    Sent as a NATS request: the scheduler answers `AddResult` (accepted, or why not). New
    tokens go to `reply_to`, the subject of the tokenizer replica that owns the stream.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    reply_to: str
    cache_salt: str | None = None  # into the first block's prefix-cache hash
    priority: int = 0  # GenerateRequest.priority
    # GenerateRequest.cache, resolved by the tokenizer: pin the prompt's first `pin_tokens`
    # tokens (their full blocks) for `pin_ttl` seconds; the scheduler checks both again
    pin_tokens: int = 0
    pin_ttl: float = 0.0
    # a drained stream's continuation: its blocks, to read instead of recomputing
    kv_source: KvHandoff | None = None


class FinishRequest(msgspec.Struct, tag="finish", array_like=True):
    """End a request early: "abort" (every sample) or "stop" (a stop string, one sample).

    The scheduler frees the blocks at once and answers with a final `SampleDelta` per sample
    it ended, so the stream's final event follows the freeing.
    """

    request_id: str
    finish_reason: str  # "abort" | "stop"
    index: int | None = None  # the sample a stop string ended; None: all of them
    stop_reason: str | None = None
    # disaggregation: the stream ended before a decode instance read the blocks this
    # (prefill) instance holds for it under this transfer id: free them now
    kv_transfer_id: str = ""


TokenizerMessage = PromptPiece | AddRequest | FinishRequest


# From the executor: `ExecutorReady` (request-reply on `.scheduler.attach`), then one
# `StepDone` or `StepFailed` per ScheduledStep on `.scheduler.outputs` (a StepDone too
# large for one message after its `StepPart`s).


class ExecutorReady(msgspec.Struct, array_like=True):
    """The executor's capacity, announced once its model and cache are allocated."""

    executor_id: str
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    model: str
    kv_on_host: bool = False  # a CPU executor: swapping blocks is a memcpy
    # tensor-parallel ranks behind this executor; each holds its shard of every block, so
    # the block ids (and the scheduler) are the same whatever the size
    world_size: int = 1
    # a disk tier under the CPU pool (kv_disk_dir): its listing follows in the step outputs
    kv_disk: bool = False
    # per KV group (engine/kv/kv_groups.py): its layers' span, 0 = full attention, w > 0 a
    # sliding window, -C chunked local attention of C tokens; empty: one full-attention group
    kv_group_windows: list[int] = []
    # its KV transfer endpoint (KvAgent.name; schemas/kv_transfer.py), "" without one
    kv_agent: str = ""
    # recurrent layers' per-sequence state slots (engine/kv/state_slots.py); 0: none
    num_state_slots: int = 0
    # state rows past those for prefix-cache snapshots at block boundaries, and one row's
    # bytes (engine/kv/state_snapshots.py)
    num_snapshot_slots: int = 0
    state_slot_bytes: int = 0
    # host rows of the state (engine/kv/host_states.py): swapped-out sequences' states, then
    # snapshots of prefix blocks on the CPU and disk tiers
    num_host_state_slots: int = 0
    num_host_snapshot_slots: int = 0
    # how the device budget was split (engine/kv/state_pool.py): one block's bytes (of every
    # layer slot) and the budget the blocks and state rows share; 0: a fixed block count
    kv_block_bytes: int = 0
    kv_budget_bytes: int = 0


class StepDone(msgspec.Struct, tag="done", array_like=True):
    """A step's output with the executor's own timings (seconds)."""

    output: StepOutput
    execute_s: float  # receipt of the step to its output
    wait_s: float  # previous output sent to this step received: idle on scheduler + NATS


class StepPart(msgspec.Struct, tag="part", array_like=True, omit_defaults=True):
    """Per-sequence outputs of step `step_id` sent ahead of its StepDone when the whole output
    would not fit in one message (services/fit.py). A sequence's prompt logprobs may span
    several parts, in order; the StepDone's own entries come last."""

    step_id: int
    beam_candidates: dict[str, list[tuple[int, float]]] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}


class StepFailed(msgspec.Struct, tag="failed", array_like=True):
    step_id: int
    message: str
    # "executor_unavailable": the executor is going away (a tensor-parallel rank was lost)
    error_type: str = "internal_error"


ExecutorMessage = StepPart | StepDone | StepFailed | KvPulled | KvSent


class SchedulerInfo(msgspec.Struct):
    """The scheduler's answer on `.scheduler.info`: is an executor attached, and its limits.

    Also the liveness ping of tokenizers and the executor: `scheduler_id` changes when the
    scheduler restarts (its requests are gone), `executor_id` names the executor it steps.
    """

    executor_attached: bool
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    scheduler_id: str = ""
    executor_id: str = ""
    # blocks held for peers to read (a drain's handoffs), and requests not yet finished:
    # a stopping executor stays up while either is above 0 (whether or not the scheduler
    # has had its own signal yet: `kvpager serve` signals both at once, in no fixed order)
    num_kv_held: int = 0
    num_unfinished: int = 0
