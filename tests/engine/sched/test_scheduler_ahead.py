"""Planning a step before the previous one's output arrives, through the engine core's own
step pipeline (the one the offline LLM and the scheduler service run).

`RowBook` keeps the executor's side of the books as engine.worker.executor does: each request's
token list and computed count, built only from the ScheduledSteps. A row that catches up samples a
token that depends on its whole token list, so any disagreement between the scheduler and the
executor about what a request holds shows up in the outputs, and in the computed-count check.
"""

import asyncio
import random
import zlib

import pytest
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.core import EngineCore
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepDone, StepOutput

EOS = 2


class RowBook:
    def __init__(self, eos_after: dict[str, int] | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.eos_after = eos_after or {}  # request id -> sample EOS once it holds this many

    def answer(self, step: ScheduledStep) -> StepOutput:
        for seq_id in step.finished_seq_ids:
            self.tokens.pop(seq_id, None)
        for new in step.new_requests:
            assert new.seq_id not in self.tokens, f"{new.seq_id} added twice"
            self.tokens[new.seq_id] = list(new.token_ids)
            self.computed[new.seq_id] = new.num_computed_tokens
        for cached in step.cached_requests:
            assert self.computed[cached.seq_id] == cached.num_computed_tokens, cached.seq_id
            self.tokens[cached.seq_id] += cached.new_token_ids
        sampled = []
        for seq_id, num in step.num_scheduled_tokens.items():
            self.computed[seq_id] += num
            if self.computed[seq_id] == len(self.tokens[seq_id]):
                sampled.append(seq_id)
        for fork in step.forks:  # copies the parent before the parent's token is appended
            self.tokens[fork.child_id] = list(self.tokens[fork.parent_id])
            self.computed[fork.child_id] = self.computed[fork.parent_id]
            sampled.append(fork.child_id)
        token_ids = [self._token(seq_id) for seq_id in sampled]
        for seq_id, token_id in zip(sampled, token_ids):
            self.tokens[seq_id].append(token_id)
        return StepOutput(step.step_id, sampled, token_ids)

    def _token(self, seq_id: str) -> int:
        tokens = self.tokens[seq_id]
        if len(tokens) == self.eos_after.get(seq_id):
            return EOS
        return 3 + zlib.crc32(f"{seq_id}:{tokens}".encode()) % 97


def make_scheduler(num_blocks: int, budget: int = 32, mode: str = "auto", cpu: int = 0):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode
        ),
        CacheConfig(block_size=4, num_blocks=num_blocks, num_cpu_blocks=cpu),
    )


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int, n: int = 1):
    params = SamplingParams(max_tokens=max_tokens, n=n, seed=1 if n > 1 else None)
    request = Request(request_id, prompt, params, eos_token_ids=(EOS,))
    scheduler.add_request(request)
    return request


class BookRunner:
    """The core's StepRunner over a RowBook: answers each step in order when awaited, and
    checks the scheduler's accounting as each step is handed over."""

    def __init__(self, scheduler: Scheduler, book: RowBook) -> None:
        self.scheduler = scheduler
        self.book = book
        self.pending: dict[int, ScheduledStep] = {}

    async def submit(self, step: ScheduledStep) -> None:
        self.scheduler.check_invariants()
        self.pending[step.step_id] = step

    async def result(self, step_id: int) -> StepDone | None:
        step = self.pending.pop(step_id, None)
        return None if step is None else StepDone(self.book.answer(step), 0.0, 0.0)

    def cancel(self) -> None:
        self.pending.clear()


def drive(scheduler: Scheduler, book: RowBook, ahead: int, max_steps: int = 2000) -> None:
    """Run the engine core with up to `ahead` steps planned beyond the one being answered."""

    async def publish(deltas, step_id) -> None:
        pass  # the tokens are read off the requests

    async def run() -> None:
        core = EngineCore(scheduler, BookRunner(scheduler, book), publish, ahead, True)
        for _ in range(max_steps):
            if not core.has_work:
                return
            await core.run_step()
        raise AssertionError("did not finish")

    asyncio.run(run())


def workload(scheduler: Scheduler, seed: int) -> dict[str, Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 100) for _ in range(8)]  # prefix hits across requests
    requests = {}
    for idx in range(10):
        prompt = shared[: rng.choice((0, 8))] + [rng.randrange(3, 100) for _ in range(5 + idx)]
        n = 2 if idx % 4 == 1 else 1
        requests[f"r{idx}"] = add(scheduler, f"r{idx}", prompt, rng.randint(1, 12), n)
    return requests


def outputs(scheduler: Scheduler, requests: dict[str, Request]) -> dict[str, list[int]]:
    return {rid: r.output_token_ids for rid, r in requests.items()} | {
        r.seq_id: r.output_token_ids
        for group in scheduler.groups.values()
        for r in group
        if r.seq_id not in requests
    }


@pytest.mark.parametrize("mode,cpu", [("recompute", 0), ("swap", 64), ("auto", 64)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_ahead_gives_the_same_tokens_under_preemption(mode, cpu, seed):
    results = []
    for ahead in (0, 1, 2):  # the services plan one step ahead; two tests the guards more
        scheduler = make_scheduler(num_blocks=14, budget=12, mode=mode, cpu=cpu)
        requests = workload(scheduler, seed)
        children = {}  # forked samples leave scheduler.groups when they finish
        original_add = scheduler.add_forked

        def add_forked(parent, child, children=children, original_add=original_add):
            children[child.seq_id] = child
            original_add(parent, child)

        scheduler.add_forked = add_forked
        drive(scheduler, RowBook(), ahead)
        finished = {**requests, **children}
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in finished.values())
        assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in finished.values())
        manager = scheduler.block_manager
        assert manager.num_free_blocks == manager.num_blocks and not manager.swapped_tables
        assert scheduler.stats.num_preemptions > 0
        results.append({rid: r.output_token_ids for rid, r in finished.items()})
    assert results[0] == results[1] == results[2]


def test_the_next_step_is_planned_before_the_output():
    scheduler = make_scheduler(num_blocks=8)
    a = add(scheduler, "a", [10, 11, 12, 13, 14], max_tokens=2)
    book = RowBook()
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first's token is not known yet
    assert first.num_scheduled_tokens == {"a": 5} and second.num_scheduled_tokens == {"a": 1}
    assert second.cached_requests[0].num_computed_tokens == 5
    assert a.num_output_tokens == 0 and a.num_output_placeholders == 2
    third = scheduler.schedule()  # both of its tokens are in flight: nothing more to compute
    assert third.num_scheduled_tokens == {}
    for step in (first, second, third):
        scheduler.update_from_output(step, book.answer(step))
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_placeholders == 0
    assert a.output_token_ids == book.tokens["a"][5:]
    assert scheduler.schedule().finished_seq_ids == ["a"]
    scheduler.check_invariants()
    assert scheduler.block_manager.num_free_blocks == 8


def test_a_stop_token_costs_one_step_whose_token_is_dropped():
    scheduler = make_scheduler(num_blocks=8)
    a = add(scheduler, "a", [10, 11, 12, 13, 14], max_tokens=8)
    book = RowBook(eos_after={"a": 6})  # a's second token is EOS
    steps = [scheduler.schedule(), scheduler.schedule()]
    scheduler.update_from_output(steps[0], book.answer(steps[0]))
    steps.append(scheduler.schedule())  # planned while a's EOS is being sampled
    assert steps[2].num_scheduled_tokens == {"a": 1}
    scheduler.update_from_output(steps[1], book.answer(steps[1]))
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids[-1] == EOS
    assert scheduler.block_manager.num_free_blocks == 8  # freed while step 3 is in flight
    scheduler.update_from_output(steps[2], book.answer(steps[2]))
    assert a.num_output_tokens == 2  # the extra token was dropped
    assert scheduler.schedule().finished_seq_ids == ["a"]
    scheduler.check_invariants()


def test_a_request_preempted_with_a_token_in_flight_keeps_it():
    scheduler = make_scheduler(num_blocks=4, mode="recompute")
    a = add(scheduler, "a", list(range(10, 18)), max_tokens=8)  # 2 blocks, a third at 9
    b = add(scheduler, "b", list(range(20, 28)), max_tokens=8)
    book = RowBook()
    first = scheduler.schedule()  # both prefill: the cache is full
    second = scheduler.schedule()  # a's decode needs a block: b, newest, is preempted
    assert b.status is RequestStatus.PREEMPTED and second.finished_seq_ids == ["b"]
    assert b.num_output_placeholders == 1  # its first token is still being sampled
    third = scheduler.schedule()  # b must not resume before its token arrives
    assert "b" not in third.num_scheduled_tokens
    scheduler.update_from_output(first, book.answer(first))
    assert b.num_output_tokens == 1 and b.num_output_placeholders == 0
    for step in (second, third):
        scheduler.update_from_output(step, book.answer(step))
    drive(scheduler, book, ahead=1)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_an_abandoned_step_is_forgotten_when_a_later_one_is_answered():
    """The services give up on a step whose executor failed, after failing its requests."""
    scheduler = make_scheduler(num_blocks=8)
    a = add(scheduler, "a", [10, 11, 12, 13, 14], max_tokens=8)
    book = RowBook()
    abandoned = scheduler.schedule()
    book.answer(abandoned)  # the executor ran it; its answer is lost
    scheduler.abort("a")
    b = add(scheduler, "b", [20, 21, 22], max_tokens=8)
    step = scheduler.schedule()
    scheduler.update_from_output(step, book.answer(step))
    assert a.output_token_ids == [] and b.num_output_tokens == 1
    assert scheduler._sampling == {}  # no step's requests are held any longer
    scheduler.check_invariants()


def test_a_served_core_plans_ahead_only_while_full():
    """With room for more sequences a request arriving mid-step must join the next step, so the
    served core keeps one step in flight; with max_num_seqs running it plans ahead as before."""

    async def publish(deltas, step_id) -> None:
        pass

    async def most_in_flight(num_requests: int) -> int:
        scheduler = make_scheduler(num_blocks=64)
        requests = [
            add(scheduler, f"r{i}", [10 + i, 11, 12], max_tokens=4) for i in range(num_requests)
        ]
        runner = BookRunner(scheduler, RowBook())
        most = 0
        submit = runner.submit

        async def counting_submit(step: ScheduledStep) -> None:
            nonlocal most
            await submit(step)
            most = max(most, len(runner.pending))

        runner.submit = counting_submit
        core = EngineCore(scheduler, runner, publish, 1, True, plan_ahead_with_room=False)
        while core.has_work:
            await core.run_step()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
        scheduler.check_invariants()
        assert scheduler.block_manager.num_free_blocks == 64
        return most

    assert asyncio.run(most_in_flight(3)) == 1  # 3 of 8 seats taken: lockstep
    assert asyncio.run(most_in_flight(8)) == 2  # all 8 running: one step planned ahead


def test_a_served_core_hands_on_each_step_before_awaiting_the_next():
    """When the pipeline drains (prompts stopped waiting, so nothing more is planned ahead),
    the tokens of the step just absorbed still go out before the core awaits the step in
    flight: before, they waited a whole step and reached the client with the next step's
    (issue #48: 1,000-token prompts 4 at a time got their first tokens a step late)."""
    published: list[int] = []

    async def publish(deltas, step_id) -> None:
        published.extend(len(delta.token_ids) for delta in deltas)

    async def run() -> list[int]:
        scheduler = make_scheduler(num_blocks=64)
        runner = BookRunner(scheduler, RowBook())
        core = EngineCore(scheduler, runner, publish, 1, True, plan_ahead_with_room=False)
        params = SamplingParams(max_tokens=4)
        prompts = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]  # no shared blocks
        requests = [Request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
        for request in requests:  # 3 prompts of 20 tokens, a 32-token budget: one waits
            core.add(request)
        answer, answered, late = runner.result, [0], []

        async def checked_result(step_id: int):
            late.append(answered[0] - sum(published))  # sampled by earlier steps, not yet out
            done = await answer(step_id)
            answered[0] += len(done.output.sampled_token_ids) if done is not None else 0
            return done

        runner.result = checked_result
        while core.has_work:
            await core.run_step()
        await core.publish()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
        assert scheduler.block_manager.num_free_blocks == 64
        assert sum(published) == answered[0] == 12
        return late

    late = asyncio.run(run())
    assert len(late) > 4 and not any(late)  # every step awaited with nothing held back
