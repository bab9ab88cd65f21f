"""The scheduler's counters and one step's plan while it is being made."""

from dataclasses import dataclass, field

from kvpager.engine.request import Request
from kvpager.schemas.executor import CachedRequest, ForkRequest, NewRequest


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    peak_waiting: int = 0  # the queue at its longest, as requests were added
    finished: dict[str, int] = field(default_factory=dict)

    def record_step(self, num_used_blocks: int, num_running: int) -> None:
        self.num_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, num_used_blocks)
        self.peak_running = max(self.peak_running, num_running)


@dataclass
class StepPlan:
    """What one `Scheduler.schedule()` call decided, before it becomes a ScheduledStep."""

    budget: int
    grouped: bool = False  # block tables and new ids come one per KV group
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    forks: list[ForkRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    sampling: list[Request] = field(default_factory=list)  # get a token (beams: candidates)
    forked: set[str] = field(default_factory=set)  # samples forked in this step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals verified
    held_by_limits: bool = False  # the last prompt tried waits for a partial-prefill slot

    def add_new(self, request: Request, block_table) -> None:
        """A request the executor does not hold: all its tokens and blocks."""
        tables = block_table if self.grouped else [block_table]
        self.new_requests.append(
            NewRequest(
                seq_id=request.seq_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=list(tables[0]),
                num_computed_tokens=request.num_computed_tokens,
                group_block_ids=[list(table) for table in tables[1:]],
            )
        )

    def add_cached(
        self,
        request: Request,
        block_table,
        new_block_ids,
        new_token_ids: list[int],
    ) -> None:
        """A request the executor holds: what changed since the last step."""
        # Copy-on-write may replace the shared tail block and a swap-in the whole table, so
        # new ids overwrite the table from this index rather than always appending.
        tables = block_table if self.grouped else [block_table]
        new_ids = new_block_ids if self.grouped else [new_block_ids]
        self.cached_requests.append(
            CachedRequest(
                seq_id=request.seq_id,
                num_computed_tokens=request.num_computed_tokens,
                new_block_ids=new_ids[0],
                new_token_ids=new_token_ids,
                replace_from=len(tables[0]) - len(new_ids[0]),
                spec_token_ids=self.spec_token_ids.get(request.seq_id, []),
                group_new_block_ids=[list(ids) for ids in new_ids[1:]],
                group_replace_from=[len(t) - len(i) for t, i in zip(tables[1:], new_ids[1:])],
            )
        )
