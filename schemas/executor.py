"""What the executor receives from its scheduler: one ScheduledStep per model step.

Only ids and small int lists travel: a request's tokens and block ids once (`NewRequest`),
then deltas (`CachedRequest`). The executor keeps a persistent request table and builds every
tensor (input ids, positions, slot mapping, block tables) itself.
"""

import msgspec
from kvpager.schemas.kv_transfer import KvPull
from kvpager.schemas.sampling import SamplingParams


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request new to the executor: first scheduled, or resumed after preemption."""

    seq_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed
    num_prompt_tokens: int
    sampling_params: SamplingParams  # `seed` already offset per parallel sample
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits, or tokens kept through a swap
    # the tables of KV groups 1.. (engine/kv/kv_groups.py) when the model has several;
    # -1 (NULL_BLOCK): a sliding group's block slid out of the window, never read
    group_block_ids: list[list[int]] = []


class CachedRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A running request's change since the last step."""

    seq_id: str
    num_computed_tokens: int
    new_block_ids: list[int] = []
    new_token_ids: list[int] = []  # tokens the scheduler chose (beam search), to append
    # table[replace_from:] = new_block_ids. Usually an append; copy-on-write of a shared
    # partly filled tail replaces the last block too.
    replace_from: int = 0
    # speculative decoding: proposed tokens after the last known one, verified in this step
    # (the step computes 1 + len(spec_token_ids) tokens of this request)
    spec_token_ids: list[int] = []
    # KV groups 1.. when the model has several: new_block_ids and replace_from of each
    group_new_block_ids: list[list[int]] = []
    group_replace_from: list[int] = []


class ForkRequest(msgspec.Struct, array_like=True):
    """A copy of `parent_id`'s row as `child_id`, sharing its blocks (the scheduler counted
    them), for parallel samples and beams alike.

    `sample`: the child samples its first token from the parent's logits in this step, with
    its own seed (a parallel sample forked as its parent's prompt completes; the copy is made
    after the forward pass). Otherwise the copy is made before the forward pass (a beam chosen
    twice: each copy then gets its own token from the beam search).
    """

    parent_id: str
    child_id: str
    seed: int | None = None
    sample: bool = True


class DiskBlock(msgspec.Struct, array_like=True, omit_defaults=True):
    """One full prefix block moving between the CPU tier and the disk tier: written from, or
    read into, CPU block `block_id` (a device block with `on_device`). `token_ids` go into,
    and are checked against, the file's header: a hash collision or a wrong file is never
    served."""

    block_hash: bytes  # the chained block hash (engine/kv/block_hash.py)
    block_id: int
    token_ids: list[int]
    # a write of a block that reached the CPU pool in this very step: its bytes are still
    # in device block `block_id` (the swap-out's source), not yet in the pool
    on_device: bool = False


class ScheduledStep(msgspec.Struct, array_like=True, omit_defaults=True):
    step_id: int
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    num_scheduled_tokens: dict[str, int] = {}  # every request running this step, in order
    finished_seq_ids: list[str] = []  # finished, aborted or preempted: drop their state
    blocks_to_copy: list[tuple[int, int]] = []  # (src, dst), before the forward pass
    blocks_to_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)
    forks: list[ForkRequest] = []
    # speculative decoding: after this step, propose up to this many tokens for these
    # sampling sequences (they come back in StepOutput.draft_token_ids)
    num_spec_tokens: dict[str, int] = {}
    # the disk tier: CPU blocks to snapshot and write (before this step's swap-outs reuse
    # them), and files to read into reserved CPU blocks (StepOutput.disk_loaded says when)
    blocks_to_disk: list[DiskBlock] = []
    blocks_from_disk: list[DiskBlock] = []
    # KV blocks to read from another executor once this step ran (KvPulled says when)
    kv_pulls: list[KvPull] = []
    # recurrent layers (engine/kv/state_slots.py): the state slot of each scheduled sequence
    # and each fork's child, and the slots new to a sequence (zeroed before the forward pass).
    # A fork copies its parent's slot into its child's when the executor applies the fork
    # (before the forward pass, or after it for `sample`: the state then holds the prompt)
    state_slots: dict[str, int] = {}
    state_resets: list[int] = []
    # prefix snapshots (engine/kv/state_snapshots.py): (snapshot slot, sequence slot) copied
    # before the pass; (seq id, offset in its step tokens, snapshot slot) copied out during it
    state_restores: list[tuple[int, int]] = []
    state_snapshots: list[tuple[str, int, int]] = []
    # host rows of the state (engine/kv/host_states.py), copied first of all: (device row,
    # host row) for swap-outs and snapshots leaving the device, then (host row, sequence
    # slot) for swap-ins and restores from host snapshots
    state_to_host: list[tuple[int, int]] = []
    state_from_host: list[tuple[int, int]] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


# --- Over NATS: what the executor service receives on `<prefix>.internal.<instance>.executor.
# steps`, in publish order: the pieces of a step's long token lists, its leading new requests
# when the step is too large for one message, then the step itself.


class StepPiece(msgspec.Struct, tag="piece", array_like=True):
    """Leading token ids of one of the next step's NewRequests, sent ahead to keep messages
    small; the NewRequest's own `token_ids` are the rest."""

    seq_id: str
    token_ids: list[int]


class StepRequests(msgspec.Struct, tag="requests", array_like=True):
    """Leading NewRequests of the next step, sent ahead when the whole step would not fit in
    one message (services/fit.py); the RunStep's own `new_requests` follow them."""

    new_requests: list[NewRequest]


class RunStep(msgspec.Struct, tag="step", array_like=True):
    step: ScheduledStep


SchedulerMessage = StepPiece | StepRequests | RunStep


# --- Over torch.distributed: what tensor-parallel ranks 1..N-1 receive from rank 0, in order
# (msgpack bytes broadcast on the ranks' control group; never pickles).


class RankConfig(msgspec.Struct, tag="config", array_like=True):
    """Once, first: the executor settings every rank builds its shard with (rank 0's, so
    the ranks can never disagree). `fields` are ExecutorConfig's, as JSON-friendly values."""

    fields: dict[str, str | int | float | bool | None]


class RankStep(msgspec.Struct, tag="step", array_like=True):
    """Run this step on the rank's shard (its answer is discarded: rank 0 answers)."""

    step: ScheduledStep


class RankReset(msgspec.Struct, tag="reset", array_like=True):
    """Forget every request (rank 0's scheduler changed)."""


class RankKeepalive(msgspec.Struct, tag="keepalive", array_like=True):
    """Sent while rank 0 idles, so a rank waiting for a step never reaches the group's
    timeout, and a dead or hung rank is found between steps too."""


class RankShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Rank 0 is closing: exit."""


RankMessage = RankConfig | RankStep | RankReset | RankKeepalive | RankShutdown


class Attached(msgspec.Struct, array_like=True):
    """The scheduler's answer to ExecutorReady: steps will follow."""

    scheduler_id: str
