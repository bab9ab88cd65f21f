"""The scheduler's counters and one step's plan while it is being made."""

from dataclasses import dataclass, field

from engine.request import Request
from schemas.executor import CachedRequest, ForkRequest, NewRequest


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    peak_used_blocks: int = 0
    peak_running: int = 0
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class StepPlan:
    """What one `Scheduler.schedule()` call decided, before it becomes a ScheduledStep."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    forks: list[ForkRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    sampling: list[Request] = field(default_factory=list)  # get a token (beams: candidates)
    forked: set[str] = field(default_factory=set)  # samples forked in this step
