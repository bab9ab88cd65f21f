"""vLLM's partial-prefill limits and the prompt-block reservation (engine/sched/prefill_limits.py),
driven by hand-made step outputs."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.errors import ConfigError

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.sched.test_scheduler import add, drain, run_step


def make_scheduler(num_blocks=64, budget=64, threshold=16, partial=4, long=1, reserve=False):
    limits = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=long,
        reserve_prompt_blocks=reserve,
    )
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False)
    return Scheduler(limits, cache)


def test_long_prompts_prefill_one_after_another():
    """One long prompt at a time: the first gets its token after 4 capped chunks while the
    second has not started; with no limit both share every step and finish together."""
    scheduler = make_scheduler(long=1)
    first, second = add(scheduler, "first", 60), add(scheduler, "second", 60)
    steps = [run_step(scheduler).num_scheduled_tokens for _ in range(4)]
    assert steps[:3] == [{"first": 16}] * 3
    assert steps[3] == {"first": 12, "second": 16}  # the next starts in the first's last chunk
    assert first.output_token_ids == [7] and second.num_computed_tokens == 16
    drain(scheduler)

    unlimited = make_scheduler(long=4)
    first, second = add(unlimited, "first", 60), add(unlimited, "second", 60)
    steps = [run_step(unlimited).num_scheduled_tokens for _ in range(4)]
    assert steps[0] == {"first": 16, "second": 16}
    assert first.output_token_ids == second.output_token_ids == [7]  # both in the 4th step
    drain(unlimited)


def test_a_short_prompt_starts_beside_held_long_ones():
    scheduler = make_scheduler(long=1)
    add(scheduler, "long", 60)
    add(scheduler, "held", 60)
    short = add(scheduler, "short", 6)
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"long": 16, "short": 6}  # past the held long one
    assert short.output_token_ids == [7]
    assert [r.seq_id for r in scheduler.waiting] == ["held"]
    drain(scheduler)


def test_max_num_partial_prefills_bounds_prompts_spanning_steps():
    scheduler = make_scheduler(partial=2, long=2)
    for name in ("a", "b", "c"):
        add(scheduler, name, 40)
    add(scheduler, "d", 10)  # finishes in its first chunk: never counted
    step = run_step(scheduler)
    assert step.num_scheduled_tokens == {"a": 16, "b": 16, "d": 10}
    drain(scheduler)


def test_with_the_threshold_off_one_partial_prefill_is_first_come_first_served():
    """vLLM's defaults (no cap, one partial prefill): the head takes the budget, the next gets
    what is left; nothing else starts while it spans steps."""
    scheduler = make_scheduler(budget=32, threshold=0, partial=1, long=1)
    for name in ("a", "b", "c"):
        add(scheduler, name, 20)
    assert run_step(scheduler).num_scheduled_tokens == {"a": 20, "b": 12}
    assert run_step(scheduler).num_scheduled_tokens == {"a": 1, "b": 8, "c": 20}
    drain(scheduler)


@pytest.mark.parametrize("reserve", [False, True])
def test_reserving_prompt_blocks_waits_instead_of_preempting(reserve):
    """Two 24-token prompts (6 blocks each) in a 10-block cache, prefilled 4 tokens a step:
    admitted together, the second is preempted when the first needs its blocks; with the
    reservation it starts only once the first has finished."""
    scheduler = make_scheduler(num_blocks=10, threshold=4, long=4, reserve=reserve)
    first = add(scheduler, "first", 24, max_tokens=2)
    second = add(scheduler, "second", 24, max_tokens=2)
    step = run_step(scheduler)
    assert set(step.num_scheduled_tokens) == ({"first"} if reserve else {"first", "second"})
    while not first.is_finished:
        run_step(scheduler)
    assert scheduler.stats.num_preemptions == (0 if reserve else 1)
    assert second.num_computed_tokens == 0 if reserve else second.num_preemptions == 1
    drain(scheduler)
    assert second.output_token_ids == [7, 7]


def test_partial_prefill_limits_are_checked():
    with pytest.raises(ConfigError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        EngineConfig(max_long_partial_prefills=0)
    limits = EngineConfig(max_num_partial_prefills=3, reserve_prompt_blocks=True)
    scheduler_config = limits.scheduler_config(8, 256)
    assert scheduler_config.max_num_partial_prefills == 3
    assert scheduler_config.reserve_prompt_blocks


def test_served_limits_keep_greedy_outputs_under_pressure(tiny_llama):
    """A model run: long prompts one at a time, a short one jumping, prompts held for blocks
    in a small cache; every output equals the unpressured offline run's."""
    prompts = random_prompts([70, 60, 50, 5, 40], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_llama).generate(prompts, params)]
    pressured = make_llm(
        tiny_llama,
        num_blocks=24,  # 192 tokens: the five prompts' 225 do not fit at once
        long_prefill_token_threshold=16,
        max_num_partial_prefills=4,
        max_long_partial_prefills=1,
        reserve_prompt_blocks=True,
    )
    got = [o.outputs[0].token_ids for o in pressured.generate(prompts, params)]
    assert got == expected
    assert pressured.stats()["num_preemptions"] == 0
    assert_all_free(pressured)
