"""The scheduler's side of speculative decoding, driven by hand-made step outputs: lookahead
slots in the budget, rollback of rejected tokens, the prefix cache, copy-on-write, tuning."""

from kvpager.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvpager.engine.request import Request
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput


def make_scheduler(num_blocks=16, budget=64, k=4, max_to_speculate=8, caching=False):
    spec = SpeculativeConfig(num_speculative_tokens=k, max_num_seqs_to_speculate=max_to_speculate)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64, speculative_config=spec),
        CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching),
    )


def add(scheduler, seq_id, prompt, max_tokens=16, **params) -> Request:
    request = Request(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))
    scheduler.add_request(request)
    return request


def answer(scheduler, step, emitted: dict[str, list[int]], drafts=None):
    """The executor's answer: per sequence the tokens it emitted, and new proposals."""
    seq_ids = list(emitted)
    output = StepOutput(step.step_id, seq_ids, [emitted[s][0] for s in seq_ids])
    output.extra_token_ids = {s: t[1:] for s, t in emitted.items() if len(t) > 1}
    output.draft_token_ids = drafts or {}
    scheduler.update_from_output(step, output)
    scheduler.check_invariants()


def test_lookahead_slots_and_rollback():
    scheduler = make_scheduler()
    a = add(scheduler, "a", range(10, 16))  # 6 tokens: blocks 0, 1
    step = scheduler.schedule()
    assert step.num_spec_tokens == {"a": 4} and not scheduler.can_plan_ahead
    answer(scheduler, step, {"a": [20]}, {"a": [21, 22, 23, 24]})
    # a holds 7 tokens, 6 computed; the new token and 4 proposals: positions 6..10, 3 blocks
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 5}
    assert step.cached_requests[0].spec_token_ids == [21, 22, 23, 24]
    assert len(scheduler.block_manager.get_block_table("a")) == 3
    # 1 accepted (21), then the model's 30: 9 tokens, 8 computed; block 2 only held rejects
    answer(scheduler, step, {"a": [21, 30]}, {"a": [31]})
    assert a.output_token_ids == [20, 21, 30] and a.num_computed_tokens == 8
    assert len(scheduler.block_manager.get_block_table("a")) == 2
    assert scheduler.block_manager.num_free_blocks == 14
    stats = scheduler.lookahead.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)


def test_budget_and_max_tokens_cap_the_proposals():
    scheduler = make_scheduler(budget=3)
    a = add(scheduler, "a", range(10, 13), max_tokens=16)
    answer(scheduler, scheduler.schedule(), {"a": [20]}, {"a": [21, 22, 23, 24]})
    step = scheduler.schedule()
    assert step.cached_requests[0].spec_token_ids == [21, 22]  # 1 + 2 tokens fill the budget
    answer(scheduler, step, {"a": [21, 22, 23]})
    assert a.output_token_ids == [20, 21, 22, 23] and a.num_computed_tokens == 6
    scheduler = make_scheduler()
    b = add(scheduler, "b", range(10, 13), max_tokens=3)
    answer(scheduler, scheduler.schedule(), {"b": [20]}, {"b": [21, 22]})
    step = scheduler.schedule()
    assert step.num_scheduled_tokens["b"] == 2  # one proposal: the 3rd token is the model's
    answer(scheduler, step, {"b": [21, 22]})
    assert b.is_finished and b.output_token_ids == [20, 21, 22]
    assert scheduler.block_manager.num_free_blocks == 16


def test_stop_inside_an_accepted_run_drops_the_rest():
    scheduler = make_scheduler()
    a = add(scheduler, "a", range(10, 15), stop_token_ids=[22])
    answer(scheduler, scheduler.schedule(), {"a": [20]}, {"a": [21, 22, 23]})
    answer(scheduler, scheduler.schedule(), {"a": [21, 22, 23, 24]})
    assert a.is_finished and a.output_token_ids == [20, 21, 22]
    assert scheduler.block_manager.num_free_blocks == 16


def test_prefix_cache_registers_accepted_blocks_only():
    scheduler = make_scheduler(caching=True)
    add(scheduler, "a", range(10, 13))  # 3 tokens
    answer(scheduler, scheduler.schedule(), {"a": [20]}, {"a": [21, 22, 23, 24]})
    manager = scheduler.block_manager
    step = scheduler.schedule()  # computes positions 3..7: block 1 full of proposals
    assert manager.num_cached_blocks == 1  # block 0: the 4 known tokens, no proposals
    answer(scheduler, step, {"a": [29]})  # every proposal rejected
    assert manager.num_cached_blocks == 1 and len(manager.get_block_table("a")) == 1
    assert scheduler.lookahead._k_of["a"] == 2  # none accepted: k halves


def test_copy_on_write_when_a_proposal_lands_in_a_shared_block():
    scheduler = make_scheduler()
    parent = add(scheduler, "p", range(10, 16), n=2)  # 6 tokens: tail block half full
    step = scheduler.schedule()
    child_id = step.forks[0].child_id
    answer(scheduler, step, {"p": [20], child_id: [20]}, {child_id: [21, 22]})
    manager = scheduler.block_manager
    shared_tail = manager.get_block_table("p")[1]
    step = scheduler.schedule()
    # the parent writes first and copies the shared tail; the child's token and proposals
    # (positions 6, 7, then 8 in a new block) then land in a tail no one else holds
    parent_table, child_table = manager.get_block_table("p"), manager.get_block_table(child_id)
    assert step.blocks_to_copy == [(shared_tail, parent_table[1])]
    assert child_table[1] == shared_tail and manager.blocks[shared_tail].ref_count == 1
    assert step.num_scheduled_tokens == {"p": 1, child_id: 3} and len(child_table) == 3
    answer(scheduler, step, {"p": [30], child_id: [21, 22, 40]})
    assert parent.output_token_ids == [20, 30]
    assert scheduler.seqs[child_id].output_token_ids == [20, 21, 22, 40]


def test_steps_aside_for_a_large_batch_and_plans_ahead_again():
    scheduler = make_scheduler(max_to_speculate=1)
    add(scheduler, "a", range(10, 13))
    add(scheduler, "b", range(10, 13))
    step = scheduler.schedule()
    assert step.num_spec_tokens == {} and scheduler.can_plan_ahead


def test_full_acceptance_doubles_k_within_its_bound():
    scheduler = make_scheduler(k=4)
    scheduler.lookahead._k_of["a"] = 1
    add(scheduler, "a", range(10, 13))
    answer(scheduler, scheduler.schedule(), {"a": [20]}, {"a": [21]})
    answer(scheduler, scheduler.schedule(), {"a": [21, 22]}, {"a": [23, 24]})
    assert scheduler.lookahead._k_of["a"] == 2
    answer(scheduler, scheduler.schedule(), {"a": [23, 24, 25]})
    assert scheduler.lookahead._k_of["a"] == 4


def test_a_request_rarely_accepted_stops_speculating_then_tries_again():
    from kvpager.engine.sched.lookahead import ACCEPTANCE_WINDOW, PAUSE_TOKENS

    spec = SpeculativeConfig(num_speculative_tokens=8, min_acceptance_rate=0.5)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=512, speculative_config=spec),
        CacheConfig(block_size=4, num_blocks=128),
    )
    a = add(scheduler, "a", range(10, 13), max_tokens=400)
    lookahead, token = scheduler.lookahead, 100
    step = scheduler.schedule()
    # every proposal but one in eight is rejected: a rate of 1/8 < 1/2
    while lookahead.stats.num_pauses == 0:
        asked = step.num_spec_tokens.get("a", 0)
        verified = len(step.cached_requests[0].spec_token_ids) if step.cached_requests else 0
        emitted = [token, token + 1] if verified == 8 else [token]
        answer(scheduler, step, {"a": emitted}, {"a": [7] * asked})
        lookahead._k_of["a"] = 8  # hold k, so the window fills quickly
        token += len(emitted)
        step = scheduler.schedule()
    assert lookahead.stats.num_draft_tokens >= ACCEPTANCE_WINDOW
    paused_at = a.num_output_tokens
    while a.num_output_tokens < paused_at + PAUSE_TOKENS:
        assert step.num_spec_tokens == {} and scheduler.can_plan_ahead
        answer(scheduler, step, {"a": [token]})
        token, step = token + 1, scheduler.schedule()
    assert step.num_spec_tokens == {"a": 8}  # a fresh window
    answer(scheduler, step, {"a": [token]})
    scheduler.finish(a, a.status.FINISHED_ABORTED)
    assert not lookahead._paused_until and scheduler.block_manager.num_free_blocks == 128
