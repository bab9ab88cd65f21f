"""The router's KV index and costs, fed hand-made events (no NATS)."""

import time

import msgspec
import pytest
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.router.routing import Router, RouterConfig
from kvpager.schemas.errors import ConfigError, ModelNotFoundError, NoInstanceError
from kvpager.schemas.tokenizer import (
    BlockRemoved,
    BlockStored,
    CacheCleared,
    InstanceLoad,
    KvEvents,
)

BLOCK = 4
LOAD = InstanceLoad(model="m", num_blocks=100, num_free_blocks=100, block_size=BLOCK)
PROMPT = list(range(10, 22))  # 3 full blocks


def stored(token_ids: list[int]) -> list[BlockStored]:
    hashes = prompt_block_hashes(token_ids, BLOCK)
    return [BlockStored(h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]


def router(mode: str = "kv", *names: str) -> Router:
    r = Router(RouterConfig(mode=mode, predict_s=0.0))
    for name in names or ("a", "b"):
        r.observe(name, LOAD)
    return r


def test_kv_picks_the_instance_holding_the_prefix_and_resyncs_on_a_gap():
    r = router()
    r.apply(KvEvents("b", "s1", 0, stored(PROMPT), LOAD))
    assert r.index.overlaps(prompt_block_hashes(PROMPT + [1, 2], BLOCK)) == {"b": 3}
    assert r.pick(PROMPT + [1, 2]) == "b"
    assert r.pick([99] * 12) == "a"  # no overlap anywhere: name order breaks the tie
    r.apply(KvEvents("b", "s1", 1, [BlockRemoved(stored(PROMPT)[2].block_hash)], LOAD))
    assert r.index.overlaps(prompt_block_hashes(PROMPT, BLOCK)) == {"b": 2}
    r.apply(KvEvents("b", "s1", 3, [], LOAD))  # seq 2 lost: b's blocks are forgotten
    assert r.index.num_resyncs == 1 and not r.index.overlaps(prompt_block_hashes(PROMPT, BLOCK))
    r.apply(KvEvents("b", "s1", 4, stored(PROMPT[:4]), LOAD))
    assert r.index.overlaps(prompt_block_hashes(PROMPT, BLOCK)) == {"b": 1}
    r.apply(KvEvents("b", "s1", 5, [CacheCleared()], LOAD))
    assert not r.index.holders


def test_a_new_scheduler_starts_its_instance_afresh():
    r = router()
    r.apply(KvEvents("a", "s1", 0, stored(PROMPT), LOAD))
    r.apply(KvEvents("a", "s2", 0, [], LOAD))
    assert not r.index.holders and r.index.num_resyncs == 1


def test_load_outweighs_a_small_overlap():
    r = router()
    r.apply(KvEvents("a", "s", 0, stored(PROMPT[:4]), LOAD))  # one block cached on a
    busy = InstanceLoad(model="m", num_blocks=100, num_free_blocks=90, block_size=BLOCK)
    r.observe("a", busy)
    costs = r.costs(list(r.instances.values()), PROMPT)
    w = r.config.overlap_weight  # weight x blocks to prefill + blocks in use + the request's
    assert costs == {"a": w * 2 + 10 + 4, "b": w * 3 + 0 + 4}
    assert r.pick(PROMPT) == "b"


def test_requests_in_flight_predict_their_blocks():
    r = Router(RouterConfig(predict_s=60.0))
    r.observe("a", LOAD)
    r.observe("b", LOAD)
    first = r.pick(PROMPT + [1])
    r.routed("r0", first, PROMPT + [1])
    assert r.pick(PROMPT + [2]) == first  # its prefix is predicted there
    r.release("r0")
    assert not r.instances[first].in_flight


def test_round_robin_and_least_loaded():
    r = router("round-robin", "a", "b", "c")
    assert [r.pick(PROMPT) for _ in range(4)] == ["b", "c", "a", "b"]
    r = router("least-loaded")
    r.routed("r0", "a", PROMPT)
    assert r.pick(PROMPT) == "b"


def test_errors_are_typed_and_instances_expire():
    r = router()
    with pytest.raises(ModelNotFoundError, match="other"):
        r.pick(PROMPT, model="other")
    with pytest.raises(NoInstanceError):
        r.pick(PROMPT, exclude=frozenset({"a", "b"}))
    r.observe("a", LOAD, now=0.0)
    r.observe("b", LOAD, now=100.0)
    assert r.expire(now=105.0) == ["a"]
    assert r.pick(PROMPT) == "b"
    with pytest.raises(ConfigError):
        RouterConfig(mode="random")


def on_disk(token_ids: list[int]) -> list[BlockStored]:
    return [BlockStored(h, None, tier="disk") for h in prompt_block_hashes(token_ids, BLOCK)]


def test_disk_hits_cost_between_cached_and_uncached():
    r = router("kv", "a", "b", "c", "d")
    r.apply(KvEvents("a", "s", 0, on_disk(PROMPT), LOAD))  # all 3 blocks on a's disk
    r.apply(KvEvents("c", "s", 0, stored(PROMPT), LOAD))  # all 3 on c's device
    r.apply(KvEvents("d", "s", 0, stored(PROMPT[:4]) + on_disk(PROMPT), LOAD))  # 1 + 2
    assert r.index.overlaps(prompt_block_hashes(PROMPT, BLOCK)) == {"c": 3, "d": 1}
    w, cost = r.config.overlap_weight, r.config.disk_hit_cost
    costs = r.costs(list(r.instances.values()), PROMPT)
    assert costs == {
        "a": w * 3 * cost + 4,
        "b": w * 3 + 4,
        "c": 0 + 4,
        "d": w * 2 * cost + 4,
    }
    assert costs["c"] < costs["d"] < costs["a"] < costs["b"]
    assert r.pick(PROMPT) == "c"
    removed = [BlockRemoved(h, tier="disk") for h in prompt_block_hashes(PROMPT, BLOCK)[1:]]
    r.apply(KvEvents("a", "s", 1, removed, LOAD))  # blocks 1, 2 left a's disk
    assert r.costs([r.instances["a"]], PROMPT)["a"] == w * (3 - (1 - cost)) + 4
    r.apply(KvEvents("d", "s", 1, [CacheCleared()], LOAD))
    assert not r.index.disk_by_instance.get("d") and not r.index.overlaps(
        prompt_block_hashes(PROMPT, BLOCK)
    ).get("d")
    with pytest.raises(ConfigError):
        RouterConfig(disk_hit_cost=1.5)


def test_pinned_blocks_count_in_the_cost_except_the_requests_own():
    r = router()
    until = time.time() + 300
    pinned = [BlockStored(e.block_hash, None, pinned_until=until) for e in stored(PROMPT)]
    held = InstanceLoad(
        model="m", num_blocks=100, num_free_blocks=100, block_size=BLOCK, num_pinned_free_blocks=5
    )
    r.apply(KvEvents("a", "s", 0, stored(PROMPT) + pinned, held))
    assert r.index.num_pinned("a", prompt_block_hashes(PROMPT, BLOCK), time.time()) == 3
    w = r.config.overlap_weight
    other = [99] * 12
    costs = r.costs(list(r.instances.values()), other)  # 5 free blocks held by pins on a
    assert costs == {"a": w * 3 + 5 + 4, "b": w * 3 + 4}
    assert r.pick(other) == "b"
    costs = r.costs(list(r.instances.values()), PROMPT)  # its own 3 pinned blocks are hits
    assert costs == {"a": w * 0 + 2 + 4, "b": w * 3 + 4}
    r.apply(KvEvents("a", "s", 1, [BlockRemoved(pinned[0].block_hash)], held))
    assert r.index.num_pinned("a", prompt_block_hashes(PROMPT, BLOCK), time.time()) == 2


def test_roles_new_requests_go_to_prefill_and_handed_on_streams_to_the_least_loaded_decode():
    r = Router(RouterConfig(mode="kv", predict_s=0.0))
    prefill = InstanceLoad(model="m", num_blocks=100, num_free_blocks=100, block_size=BLOCK)
    r.observe("p", msgspec.structs.replace(prefill, role="prefill"))
    r.observe("d0", msgspec.structs.replace(LOAD, role="decode", num_running=3))
    r.observe("d1", msgspec.structs.replace(LOAD, role="decode", num_running=1))
    r.apply(KvEvents("d1", "s1", 0, stored(PROMPT), msgspec.structs.replace(LOAD, role="decode")))
    assert r.pick(PROMPT) == "p"  # d1 caches the prompt, but computes no prompt
    assert r.pick(PROMPT, phase="decode") == "d1"  # fewest requests
    r.observe("d1", msgspec.structs.replace(LOAD, role="decode", num_running=5))
    assert r.pick(PROMPT, phase="decode") == "d0"
    assert r.pick(PROMPT, phase="decode", exclude=frozenset({"d0", "d1"})) == "p"  # none left
    both = router("kv", "a")
    assert both.pick(PROMPT) == both.pick(PROMPT, phase="decode") == "a"  # no roles: as before
