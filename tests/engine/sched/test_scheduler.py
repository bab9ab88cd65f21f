"""The scheduler driven by hand-made step outputs: budgets, preemption, forks, finishing."""

from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput


def make_scheduler(
    num_blocks=8, budget=64, max_num_seqs=8, max_model_len=64, threshold=0, **cache
) -> Scheduler:
    cache.setdefault("enable_prefix_caching", False)  # the prompts below share prefixes
    limits = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(limits, CacheConfig(block_size=4, num_blocks=num_blocks, **cache))


def add(scheduler, request_id, num_prompt, max_tokens=4, **params) -> Request:
    request = Request(
        request_id,
        list(range(10, 10 + num_prompt)),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=(2,),
    )
    scheduler.add_request(request)
    return request


def run_step(scheduler, token=7):
    """Schedule a step and answer it as an executor would: a token for each caught-up row."""
    step = scheduler.schedule()
    sampled = [  # caught up: schedule() gave them a placeholder for the coming token
        seq_id
        for seq_id in step.num_scheduled_tokens
        if scheduler.seqs[seq_id].num_output_placeholders
    ] + [fork.child_id for fork in step.forks]
    output = StepOutput(step.step_id, sampled, [token] * len(sampled))
    scheduler.update_from_output(step, output)
    scheduler.check_invariants()
    return step


def test_budget_chunks_prefill_and_runs_decode_first():
    scheduler = make_scheduler(budget=6)
    a = add(scheduler, "a", 5)
    b = add(scheduler, "b", 9)
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"a": 5, "b": 1}  # b's prefill starts with 1 token
    assert [r.seq_id for r in step.new_requests] == ["a", "b"]
    assert a.output_token_ids == [7] and b.output_token_ids == []
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"a": 1, "b": 5}  # running decode first, then chunk
    assert [c.seq_id for c in step.cached_requests] == ["a", "b"]
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"a": 1, "b": 3}
    assert b.output_token_ids == [7]


def test_preempts_newest_and_resumes_it_first():
    scheduler = make_scheduler(num_blocks=4)
    a = add(scheduler, "a", 8, max_tokens=8)  # 2 full blocks now, up to 4
    b = add(scheduler, "b", 8, max_tokens=8)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    step = run_step(scheduler)  # a needs a third block: b (newest) is preempted
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert step.num_scheduled_tokens == {"a": 1}
    assert scheduler.stats.num_preemptions == 1
    assert step.finished_seq_ids == ["b"]  # in the same step: the executor drops b's row
    while a.status is RequestStatus.RUNNING:
        run_step(scheduler)
    assert a.status is RequestStatus.FINISHED_LENGTH
    step = run_step(scheduler)
    assert [r.seq_id for r in step.new_requests] == ["b"]
    assert step.new_requests[0].token_ids == b.all_token_ids[:-1]  # prompt and 1 output


def test_fork_samples_share_blocks_and_copy_on_write():
    scheduler = make_scheduler()
    parent = add(scheduler, "p", 6, n=3, seed=5)
    step = run_step(scheduler)
    assert [(f.parent_id, f.child_id, f.seed) for f in step.forks] == [
        ("p", "p#1", 6),
        ("p", "p#2", 7),
    ]
    tables = scheduler.block_manager.block_tables
    assert tables["p"] == tables["p#1"] == tables["p#2"] == [0, 1]
    step = run_step(scheduler)  # each writes position 6 into shared block 1
    assert step.blocks_to_copy == [(1, 2), (1, 3)]  # the last writer keeps block 1
    assert tables["p"] == [0, 2] and tables["p#1"] == [0, 3] and tables["p#2"] == [0, 1]
    assert [c.replace_from for c in step.cached_requests] == [1, 1, 2]
    assert parent.num_output_tokens == 2


def test_finish_abort_and_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, "a", 3)
    add(scheduler, "b", 3)
    c = add(scheduler, "c", 3)
    step = run_step(scheduler)
    assert set(step.num_scheduled_tokens) == {"a", "b"}  # c waits for a seat
    assert scheduler.abort("a")
    step = run_step(scheduler)
    assert step.finished_seq_ids == ["a"]
    assert set(step.num_scheduled_tokens) == {"b", "c"}
    assert c.status is RequestStatus.RUNNING
    assert not scheduler.abort("a")
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert scheduler.stats.finished == {"abort": 1, "length": 2}
    assert scheduler.block_manager.num_free_blocks == 8


def test_eos_and_stop_token_finish():
    scheduler = make_scheduler()
    a = add(scheduler, "a", 3, max_tokens=8)
    b = add(scheduler, "b", 3, max_tokens=8, stop_token_ids=[9], min_tokens=3)
    run_step(scheduler, token=2)  # EOS: a stops, b has not reached min_tokens
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert b.status is RequestStatus.RUNNING
    run_step(scheduler, token=9)  # b's stop token, but min_tokens=3 is not yet reached
    assert b.status is RequestStatus.RUNNING
    run_step(scheduler, token=9)
    assert b.status is RequestStatus.FINISHED_STOPPED and b.stop_reason == 9


def test_auto_preemption_swaps_lone_requests_only_where_swapping_is_cheap():
    for cheap, expected in ((False, RequestStatus.PREEMPTED), (True, RequestStatus.SWAPPED)):
        scheduler = make_scheduler(num_blocks=4, num_cpu_blocks=8, swap_is_cheap=cheap)
        add(scheduler, "a", 8, max_tokens=8)
        b = add(scheduler, "b", 8, max_tokens=8)
        run_step(scheduler)
        run_step(scheduler)  # a needs a third block: b is preempted
        assert b.status is expected
        assert scheduler.stats.num_swap_preemptions == int(cheap)


def test_a_long_prefill_leaves_room_for_short_requests():
    """vLLM's long_prefill_token_threshold: a long prompt gets at most the threshold a step,
    so a short request starts in the first step instead of after it."""
    scheduler = make_scheduler(num_blocks=64, max_model_len=256, threshold=16)
    add(scheduler, "long", 120)
    add(scheduler, "short", 6)
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"long": 16, "short": 6}
    run_step(scheduler)  # the short one decodes beside the long one's next chunk
    assert scheduler.seqs["long"].num_computed_tokens == 32


def test_a_prompt_alone_that_fits_the_step_is_not_capped():
    """Capping a lone prompt would only split it: one that fits the budget takes one step.
    One that does not fit, or one with others waiting, is still capped."""
    scheduler = make_scheduler(num_blocks=64, max_model_len=256, threshold=16)
    add(scheduler, "alone", 60)
    assert run_step(scheduler).num_scheduled_tokens == {"alone": 60}
    add(scheduler, "beside", 60)  # the first one decodes: the second is capped
    assert run_step(scheduler).num_scheduled_tokens == {"alone": 1, "beside": 16}
    drain(scheduler)

    scheduler = make_scheduler(num_blocks=64, max_model_len=256, threshold=16)
    add(scheduler, "longer", 100)  # past the 64-token budget
    assert run_step(scheduler).num_scheduled_tokens == {"longer": 16}
    drain(scheduler)

    scheduler = make_scheduler(num_blocks=64, max_model_len=256, threshold=16)
    add(scheduler, "first", 60)
    add(scheduler, "second", 4)
    assert run_step(scheduler).num_scheduled_tokens == {"first": 16, "second": 4}
    add(scheduler, "third", 4)  # the first's rest fits, but others run
    assert run_step(scheduler).num_scheduled_tokens == {"first": 16, "second": 1, "third": 4}
    drain(scheduler)


def drain(scheduler) -> None:
    """Run to the end; every block comes back."""
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == scheduler.cache_config.num_blocks


def test_a_forking_parent_is_not_capped():
    scheduler = make_scheduler(num_blocks=64, max_model_len=256, threshold=16)
    add(scheduler, "long", 120)
    assert run_step(scheduler).num_scheduled_tokens == {"long": 16}
    add(scheduler, "parent", 40, n=2)  # samples fork from it: never capped
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"long": 16, "parent": 40}
