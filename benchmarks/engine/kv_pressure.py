"""Scheduling under KV pressure, counted, not timed: the real Scheduler and block manager on
SmolLM2-sized token counts, no model. Scheduling decisions depend only on counts, so the
numbers are the same on a busy machine as on a quiet one.

    python -m benchmarks.engine.kv_pressure [--conversations 4] [--prompt-tokens 1500]
        [--turns 4] [--flood-tokens 900] [--kv-tokens 5800] [--budget 2048] [--policies ...]

The workload of benchmarks/serving/agent_conversations.py as the lead ran it (issue #47):
`--conversations` conversations start at once with `--prompt-tokens` prompts; each turn streams
`--output-tokens`, thinks `--think-steps` steps, then returns with its whole history plus
`--user-tokens`. Meanwhile one-shot `--flood-tokens` requests arrive one at a time (the next
when the last finishes). The KV cache holds `--kv-tokens` tokens (256 MiB of SmolLM2 fp32 is
about 5,800), with no CPU pool: preemption recomputes.

Per policy (engine/config.py SchedulerConfig's knobs) it prints, for first turns, later turns
and the flood: steps and tokens computed from arrival to the first token (p50 / max), and the
tokens recomputed by preemption and the prefix-cache tokens returning turns lost to eviction.
Tokens computed stand in for time: on a CPU a step costs about its tokens.
"""

import argparse
import logging
import random
from dataclasses import dataclass, field

import structlog
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput

SAMPLED_TOKEN = 7
FINISHED = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)  # not aborted
UNLIMITED = 1 << 20
POLICIES: dict[str, dict] = {
    # `kvpager serve` before: every prompt capped at 512 a step, all prefilling at once
    "serve-before": dict(long_prefill_token_threshold=512, max_num_partial_prefills=UNLIMITED,
                       max_long_partial_prefills=UNLIMITED, reserve_prompt_blocks=False),
    # vLLM v1's defaults: no cap, first come first served at the whole budget
    "vllm-fcfs": dict(long_prefill_token_threshold=0, max_num_partial_prefills=1,
                      max_long_partial_prefills=1, reserve_prompt_blocks=False),
    # `kvpager serve` now: capped, but one long prompt prefilling at a time (a short one
    # starts beside it)
    "serve": dict(long_prefill_token_threshold=512, max_num_partial_prefills=4,
                     max_long_partial_prefills=1, reserve_prompt_blocks=False),
    # the same with a 1,024-token threshold: ~900-token prompts are short
    "serve-1024": dict(long_prefill_token_threshold=1024, max_num_partial_prefills=4,
                       max_long_partial_prefills=1, reserve_prompt_blocks=False),
    # and no admission that finishing would preempt for (--reserve-prompt-blocks)
    "serve+reserve": dict(long_prefill_token_threshold=512, max_num_partial_prefills=4,
                   max_long_partial_prefills=1, reserve_prompt_blocks=True),
    "vllm-fcfs+reserve": dict(long_prefill_token_threshold=0, max_num_partial_prefills=1,
                              max_long_partial_prefills=1, reserve_prompt_blocks=True),
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    num_conversations: int = 4
    prompt_tokens: int = 1500
    turns: int = 4
    user_tokens: int = 60
    output_tokens: int = 32
    think_steps: int = 3
    flood_tokens: int = 900
    flood_output_tokens: int = 32
    kv_tokens: int = 5800
    block_size: int = 16
    budget: int = 2048
    # a step's fixed cost in token-equivalents (weights read, launch): SmolLM2 fp32 on 2 CPU
    # cores decodes a small batch in ~70 ms and prefills ~2 ms a token
    step_cost: int = 32
    short_tokens: int = 64  # a short request every `short_every` steps (0: none)
    short_every: int = 8
    jitter: float = 0.2  # seeds past 0: lengths vary this much, think steps 1 to twice theirs
    max_steps: int = 20_000


@dataclass
class Track:
    """One request's counts: when it arrived and got its first token, what it computed."""

    kind: str  # "first", "later", "flood" or "short"
    request: Request
    arrival: tuple[int, int]  # (steps, cost) so far, at arrival
    first: tuple[int, int] | None = None
    num_scheduled: int = 0
    num_prev_tokens: int = 0  # a returning turn: the history it had computed before

    @property
    def ttft(self) -> tuple[int, int]:
        assert self.first is not None, f"{self.request.seq_id}: no first token"
        return self.first[0] - self.arrival[0], self.first[1] - self.arrival[1]

    @property
    def num_recomputed(self) -> int:
        """Tokens computed beyond the prompt past its first hit and the outputs fed back."""
        request = self.request
        needed = request.num_tokens - 1 - request.num_cached_tokens
        return self.num_scheduled - needed

    def num_lost(self, block_size: int) -> int:
        """History tokens whose blocks were cached when the turn ended but not at return."""
        cached = (self.num_prev_tokens - 1) // block_size * block_size
        return max(0, cached - self.request.num_cached_tokens)


@dataclass
class Replay:
    """The workload driven through one scheduler, step by step."""

    work: Workload
    scheduler: Scheduler
    seed: int = 0
    rng: random.Random = field(init=False)
    tracks: dict[str, Track] = field(default_factory=dict)
    # returning turns: (step due, conversation, turn, history)
    due: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    num_steps: int = 0
    num_tokens: int = 0
    cost: int = 0  # tokens computed plus step_cost a step: the clock TTFTs are read on
    num_flood: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def add(self, seq_id: str, kind: str, prompt: list[int], max_tokens: int) -> Track:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(seq_id, prompt, params)
        self.scheduler.add_request(request)
        track = Track(kind, request, (self.num_steps, self.cost))
        self.tracks[seq_id] = track
        return track

    def tokens(self, count: int) -> list[int]:
        """Random token ids, `count` give or take `jitter` (seed 0: exactly `count`)."""
        spread = int(count * self.work.jitter) if self.seed else 0
        count += self.rng.randint(-spread, spread)
        return [self.rng.randrange(100, 49_000) for _ in range(count)]

    def think(self) -> int:
        think = self.work.think_steps
        return self.rng.randint(1, 2 * think) if self.seed else think

    def add_turn(self, conv: int, turn: int, history: list[int]) -> None:
        """Turn 0: a fresh prompt; later turns: the history plus a user message."""
        work = self.work
        prompt = (
            history + self.tokens(work.user_tokens) if turn else self.tokens(work.prompt_tokens)
        )
        kind = "later" if turn else "first"
        track = self.add(f"c{conv}-t{turn}", kind, prompt, work.output_tokens)
        track.num_prev_tokens = len(history)

    def add_flood(self) -> None:
        prompt = self.tokens(self.work.flood_tokens)
        self.add(f"f{self.num_flood}", "flood", prompt, self.work.flood_output_tokens)
        self.num_flood += 1

    def step(self) -> None:
        for item in [d for d in self.due if d[0] <= self.num_steps]:
            self.due.remove(item)
            self.add_turn(*item[1:])
        every = self.work.short_every
        if every and self.num_steps % every == every // 2:
            prompt = self.tokens(self.work.short_tokens)
            self.add(f"s{self.num_steps}", "short", prompt, self.work.flood_output_tokens)
        step = self.scheduler.schedule()
        sampled = [
            s for s in step.num_scheduled_tokens if self.scheduler.seqs[s].num_output_placeholders
        ]
        self.num_steps += 1
        self.num_tokens += sum(step.num_scheduled_tokens.values())
        self.cost += self.work.step_cost + sum(step.num_scheduled_tokens.values())
        for seq_id, count in step.num_scheduled_tokens.items():
            self.tracks[seq_id].num_scheduled += count
        output = StepOutput(step.step_id, sampled, [SAMPLED_TOKEN] * len(sampled))
        for request in self.scheduler.update_from_output(step, output):
            self.on_token(self.tracks[request.seq_id])
        self.scheduler.check_invariants()

    def on_token(self, track: Track) -> None:
        if track.first is None:
            track.first = (self.num_steps, self.cost)
        if not track.request.is_finished:
            return
        if track.kind == "flood":
            self.add_flood()
        if track.kind in ("flood", "short"):
            return
        conv, turn = (int(x[1:]) for x in track.request.seq_id.split("-"))
        if turn + 1 < self.work.turns:
            history = track.request.all_token_ids
            self.due.append((self.num_steps + self.think(), conv, turn + 1, history))

    @property
    def conversations_done(self) -> bool:
        turns = [t for t in self.tracks.values() if t.kind in ("first", "later")]
        done = sum(t.request.is_finished for t in turns)
        return not self.due and done == self.work.num_conversations * self.work.turns


def make_scheduler(policy: dict, work: Workload) -> Scheduler:
    limits = SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=work.budget, max_model_len=8192, **policy
    )
    cache = CacheConfig(work.block_size, work.kv_tokens // work.block_size)
    return Scheduler(limits, cache)


def replay(policy: dict, work: Workload, seed: int = 0) -> Replay:
    """Run the workload to the conversations' last turn under one policy."""
    run = Replay(work, make_scheduler(policy, work), seed)
    for conv in range(work.num_conversations):
        run.add_turn(conv, 0, [])
    run.add_flood()
    while not run.conversations_done:
        assert run.num_steps < work.max_steps, "the workload did not finish"
        run.step()
    for seq_id in list(run.scheduler.seqs):  # the flood and short requests still in flight
        run.scheduler.abort(seq_id)
    run.scheduler.check_invariants()
    return run


def percentiles(values: list[int]) -> tuple[int, int]:
    """p50 and p90 (nearest rank)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)]


def summary(runs: list[Replay]) -> dict[str, object]:
    """Over the runs' requests pooled: TTFT in steps and cost (p50 / p90) per kind; summed
    over runs: flood requests done, preemptions, tokens recomputed and prefix tokens lost."""
    tracks = [track for run in runs for track in run.tracks.values()]
    row: dict[str, object] = {}
    for kind in ("first", "later", "flood", "short"):
        ttfts = [t.ttft for t in tracks if t.kind == kind and t.first]
        row[f"{kind}_steps"] = percentiles([ttft[0] for ttft in ttfts])
        row[f"{kind}_cost"] = percentiles([ttft[1] for ttft in ttfts])
    done = [t for t in tracks if t.request.status in FINISHED]
    row["flood_done"] = sum(t.kind == "flood" for t in done)
    row["preemptions"] = sum(run.scheduler.stats.num_preemptions for run in runs)
    row["recomputed"] = sum(t.num_recomputed for t in done)
    size = runs[0].work.block_size
    row["prefix_lost"] = sum(t.num_lost(size) for t in done if t.kind == "later")
    row["steps"] = sum(run.num_steps for run in runs)
    row["cost"] = sum(run.cost for run in runs)
    return row


def print_table(rows: dict[str, dict[str, object]]) -> None:
    columns = list(next(iter(rows.values())))
    print("policy".ljust(18) + "".join(c.rjust(12) for c in columns))
    for name, row in rows.items():
        cells = [
            "/".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
            for value in row.values()
        ]
        print(name.ljust(18) + "".join(cell.rjust(12) for cell in cells))


INT_FLAGS = (
    "num_conversations", "prompt_tokens", "turns", "user_tokens", "output_tokens",
    "think_steps", "flood_tokens", "flood_output_tokens", "kv_tokens", "budget", "step_cost",
    "short_tokens", "short_every",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Workload()
    for name in INT_FLAGS:
        flag = "--" + name.removeprefix("num_").replace("_", "-")
        parser.add_argument(flag, dest=name, type=int, default=getattr(defaults, name))
    parser.add_argument("--seeds", type=int, default=8, help="runs; past seed 0, jittered")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    args = vars(parser.parse_args())
    level = structlog.make_filtering_bound_logger(logging.INFO)  # no line per preemption
    structlog.configure(wrapper_class=level)
    seeds, policies = range(args.pop("seeds")), args.pop("policies")
    work = Workload(**args)
    print(f"{work}, {len(seeds)} seeds")
    print("TTFT as p50/p90 from arrival, in steps and in cost (tokens + step_cost a step)")
    rows = {name: summary([replay(POLICIES[name], work, s) for s in seeds]) for name in policies}
    print_table(rows)


if __name__ == "__main__":
    main()
