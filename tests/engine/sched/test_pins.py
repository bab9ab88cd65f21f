"""Pinned prompt-cache blocks (engine/kv/pins.py) and priority, through the scheduler driven by
hand-made step outputs: floods, demotion, TTLs, quotas, preemption, usage."""

import pytest
from kvpager.engine.config import CacheConfig, SchedulerConfig
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.scheduler import Scheduler
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput
from kvpager.schemas.tokenizer import BlockStored

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=8, num_cpu_blocks=0, fraction=0.5, per_key=0, **limits):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, **limits)
    cache = CacheConfig(
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_pinned_fraction=fraction,
        max_pinned_blocks_per_key=per_key,
    )
    scheduler = Scheduler(config, cache)
    clock = FakeClock()
    pool = scheduler.block_manager.pool
    pool.set_pin_limits(cache.max_pinned_blocks, per_key, clock)
    return scheduler, clock


def request(seq_id, tokens, pin=0, ttl=300.0, key=None, priority=0, max_tokens=1) -> Request:
    return Request(
        seq_id,
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        eos_token_ids=(2,),
        cache_salt=key,
        priority=priority,
        pin_tokens=pin,
        pin_ttl=ttl,
    )


def run_step(scheduler: Scheduler):
    step = scheduler.schedule()
    sampled = [s for s in step.num_scheduled_tokens if scheduler.seqs[s].num_output_placeholders]
    scheduler.update_from_output(step, StepOutput(step.step_id, sampled, [7] * len(sampled)))
    scheduler.check_invariants()
    return step


def run(scheduler: Scheduler, *requests: Request) -> None:
    for r in requests:
        scheduler.add_request(r)
    while scheduler.has_unfinished:
        run_step(scheduler)


def prompt(base: int, num_tokens: int = 9) -> list[int]:
    return list(range(base, base + num_tokens))


def num_hits(scheduler: Scheduler, tokens: list[int], key=None) -> int:
    return len(scheduler.block_manager.find_cached_prefix(request("probe", tokens, key=key)))


def all_free(scheduler: Scheduler) -> None:
    scheduler.check_invariants()
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not manager.block_tables and not manager.swapped_tables


def test_a_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one():
    scheduler, _ = make_scheduler(num_blocks=8)
    pinned, unpinned = prompt(100), prompt(200)  # 2 full blocks + 1 token each
    first = request("p", pinned, pin=8)
    run(scheduler, first, request("u", unpinned))
    assert first.num_cache_write_tokens == 8
    assert num_hits(scheduler, pinned) == 2 and num_hits(scheduler, unpinned) == 2
    for idx in range(6):  # one-shot requests that fill the cache, one at a time
        run(scheduler, request(f"flood{idx}", prompt(1000 + 100 * idx, 17)))
    assert num_hits(scheduler, unpinned) == 0  # LRU took it
    assert num_hits(scheduler, pinned) == 2  # evicted last: never needed
    second = request("p2", pinned, pin=8)
    run(scheduler, second)
    assert second.num_cached_tokens == 8 and second.num_cache_write_tokens == 0
    assert second.cached_tokens_by_tier == {"device": 8}
    all_free(scheduler)


def test_pressure_demotes_pinned_blocks_to_the_cpu_tier_rather_than_dropping_them():
    scheduler, _ = make_scheduler(num_blocks=8, num_cpu_blocks=8, fraction=1.0)
    pinned = prompt(100)
    run(scheduler, request("p", pinned, pin=8))
    run(scheduler, request("big", prompt(500, 29), max_tokens=3))  # needs all 8 blocks
    pool = scheduler.block_manager.pool
    assert pool.pins.num_pinned == 0 and pool.pins.num_pinned_evictions == 2
    again = request("p2", pinned)  # no `cache` of its own
    run(scheduler, again)
    assert again.cached_tokens_by_tier == {"cpu": 8}  # read back from the CPU tier
    assert pool.pins.num_pinned == 2 and pool.pins.num_restored == 2  # pinned again
    assert again.num_cache_write_tokens == 0
    all_free(scheduler)


def test_a_demoted_pin_that_ended_meanwhile_comes_back_unpinned():
    scheduler, clock = make_scheduler(num_blocks=8, num_cpu_blocks=8, fraction=1.0)
    run(scheduler, request("p", prompt(100), pin=8, ttl=60.0))
    run(scheduler, request("big", prompt(500, 29), max_tokens=3))
    clock.now += 61
    again = request("p2", prompt(100))
    run(scheduler, again)
    assert again.cached_tokens_by_tier == {"cpu": 8}
    assert scheduler.block_manager.pool.pins.num_pinned == 0
    all_free(scheduler)


def test_without_a_cpu_tier_pressure_drops_pins_last():
    scheduler, _ = make_scheduler(num_blocks=8, fraction=1.0)
    run(scheduler, request("p", prompt(100), pin=8), request("u", prompt(200)))
    run(scheduler, request("big", prompt(500, 21), max_tokens=3))  # 6 blocks: 2 left free
    assert num_hits(scheduler, prompt(100)) == 2 and num_hits(scheduler, prompt(200)) == 0
    all_free(scheduler)


def test_an_expired_pin_is_an_lru_entry_again_and_a_hit_refreshes_a_pin():
    scheduler, clock = make_scheduler(num_blocks=8)
    pinned, other = prompt(100), prompt(300)
    run(scheduler, request("p", pinned, pin=8, ttl=60.0), request("q", other, pin=8, ttl=60.0))
    clock.now += 40
    run(scheduler, request("hit", pinned))  # no `cache` of its own: the hit alone refreshes
    clock.now += 40  # past q's expiry, not p's refreshed one
    for idx in range(6):
        run(scheduler, request(f"flood{idx}", prompt(1000 + 100 * idx, 17)))
    assert num_hits(scheduler, pinned) == 2
    assert num_hits(scheduler, other) == 0  # expired, then evicted as LRU
    clock.now += 61
    scheduler.block_manager.pool.expire_pins()
    assert scheduler.block_manager.pool.pins.num_pinned == 0
    all_free(scheduler)


def test_per_key_quota_and_max_fraction_bound_pins():
    scheduler, _ = make_scheduler(num_blocks=16, fraction=0.5, per_key=4)  # 8 in all
    a1 = request("a1", prompt(100, 13), pin=12, key="a")  # 3 blocks
    a2 = request("a2", prompt(200, 9), pin=8, key="a")  # 2 more: over a's 4
    run(scheduler, a1, a2)
    assert a1.num_cache_write_tokens == 12
    assert a2.num_cache_write_tokens == 0 and a2.pin_tokens == 0  # ran unpinned
    assert a2.status is RequestStatus.FINISHED_LENGTH
    b = request("b", prompt(300, 17), pin=16, key="b")  # 4 blocks: b's whole quota
    c = request("c", prompt(400, 9), pin=8, key="c")  # 2 more: past the total of 8
    run(scheduler, b, c)
    pins = scheduler.block_manager.pool.pins
    assert b.num_cache_write_tokens == 16 and c.num_cache_write_tokens == 0
    assert pins.per_key == {"a": 3, "b": 4} and pins.num_pinned == 7
    all_free(scheduler)


def test_one_tenant_cannot_pin_the_whole_cache():
    scheduler, _ = make_scheduler(num_blocks=16, fraction=1.0, per_key=6)
    for idx in range(8):
        run(scheduler, request(f"t{idx}", prompt(100 * (idx + 1), 9), pin=8, key="tenant"))
    pins = scheduler.block_manager.pool.pins
    assert pins.num_pinned == 6  # three requests pinned, the rest ran unpinned
    other = request("other", prompt(5000, 9), pin=8, key="other")
    run(scheduler, other)
    assert other.num_cache_write_tokens == 8
    all_free(scheduler)


def test_swap_preemption_keeps_a_pinned_block_on_the_device():
    scheduler, _ = make_scheduler(num_blocks=6, num_cpu_blocks=8, preemption_mode="swap")
    holder = request("holder", prompt(100), pin=8, max_tokens=8)  # 2 pinned blocks + 1
    other = request("other", prompt(200), max_tokens=12)
    scheduler.add_request(holder)
    scheduler.add_request(other)
    swapped_out = []
    while scheduler.has_unfinished:
        step = run_step(scheduler)
        swapped_out += [device for device, _ in step.blocks_to_swap_out]
        if holder.status is RequestStatus.SWAPPED:
            pinned_ids = set(scheduler.block_manager.pool.pins.pins)
            assert pinned_ids and not pinned_ids & set(swapped_out)
            sharer = request("sharer", prompt(100), max_tokens=1)
            hits = scheduler.block_manager.find_cached_prefix(sharer)
            assert {h.block_id for h in hits} == pinned_ids  # still served from the device
    assert scheduler.stats.num_swap_preemptions >= 1
    all_free(scheduler)


def test_recompute_preemption_leaves_pinned_blocks_cached():
    scheduler, _ = make_scheduler(num_blocks=6, preemption_mode="recompute")
    run(scheduler, request("holder", prompt(100), pin=8))
    other = request("other", prompt(200), max_tokens=8)
    sharer = request("sharer", prompt(100), max_tokens=8)  # newest: preempted first
    scheduler.add_request(other)
    scheduler.add_request(sharer)
    while sharer.status is not RequestStatus.PREEMPTED:
        run_step(scheduler)
    assert num_hits(scheduler, prompt(100)) == 2  # freed, yet cached and pinned
    step = run_step(scheduler)  # other grows into an unpinned block, not the pinned ones
    assert num_hits(scheduler, prompt(100)) == 2 and "other" in step.num_scheduled_tokens
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert sharer.num_cached_tokens == 8
    all_free(scheduler)


def test_priority_orders_the_waiting_queue_then_arrival():
    scheduler, _ = make_scheduler()
    names = [("a", 5), ("b", 0), ("c", -1), ("d", 0), ("e", 5)]
    for name, priority in names:
        scheduler.add_request(request(name, prompt(100), priority=priority))
    assert [r.seq_id for r in scheduler.waiting] == ["c", "b", "d", "a", "e"]
    while scheduler.has_unfinished:
        run_step(scheduler)
    all_free(scheduler)


def test_preemption_takes_the_least_urgent_request_not_the_newest():
    scheduler, _ = make_scheduler(num_blocks=4, preemption_mode="recompute")
    low = request("low", prompt(100, 7), priority=5, max_tokens=8)
    scheduler.add_request(low)
    run_step(scheduler)  # low runs, 2 blocks
    high = request("high", prompt(200, 7), priority=-1, max_tokens=8)
    scheduler.add_request(high)
    run_step(scheduler)  # high joins: the cache is full
    step = run_step(scheduler)  # low needs a third block: it goes, not the newest (high)
    assert low.status is RequestStatus.PREEMPTED and high.status is RequestStatus.RUNNING
    assert list(step.num_scheduled_tokens) == ["high"]
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert low.status is RequestStatus.FINISHED_LENGTH
    all_free(scheduler)


def test_blocks_of_a_low_priority_request_are_evicted_first():
    scheduler, _ = make_scheduler(num_blocks=8)
    run(scheduler, request("high", prompt(100)), request("low", prompt(200), priority=3))
    run(scheduler, request("new", prompt(300, 5)))  # takes 2 free blocks
    run(scheduler, request("new2", prompt(400, 9)))  # takes 3 more: the low one's go first
    assert num_hits(scheduler, prompt(200)) == 0 and num_hits(scheduler, prompt(100)) == 2
    all_free(scheduler)


def test_kv_events_announce_pins():
    scheduler, _ = make_scheduler(num_blocks=8)
    scheduler.block_manager.record_kv_events()
    run(scheduler, request("p", prompt(100), pin=8))
    events = scheduler.block_manager.take_kv_events()
    pinned = [e for e in events if isinstance(e, BlockStored) and e.pinned_until is not None]
    assert len(pinned) == 2 and all(e.pinned_until > 0 for e in pinned)


def test_a_pin_past_the_prompt_is_refused():
    scheduler, _ = make_scheduler()
    with pytest.raises(InvalidRequestError, match="cache.prefix_tokens"):
        scheduler.add_request(request("p", prompt(100), pin=10))
    with pytest.raises(InvalidRequestError, match="cache.ttl"):
        scheduler.add_request(request("q", prompt(100), pin=8, ttl=0.0))
    all_free(scheduler)


def test_pins_across_kv_groups_share_one_pool():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    cache = CacheConfig(block_size=BLOCK, num_blocks=16, group_windows=(0, 8))
    scheduler = Scheduler(config, cache)
    first = request("p", prompt(100, 13), pin=12)
    run(scheduler, first)
    assert first.num_cache_write_tokens == 12  # the untagged (full) group's tokens
    pins = scheduler.block_manager.pool.pins
    assert pins.num_pinned == 6  # 3 blocks a group: the window's pinned as they were computed
    second = request("p2", prompt(100, 13), pin=12)
    run(scheduler, second)
    assert second.num_cached_tokens == 12 and second.num_cache_write_tokens == 0
    all_free(scheduler)
