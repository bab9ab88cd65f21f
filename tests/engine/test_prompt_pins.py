"""`cache` (pinned prompt prefixes) and `priority` through the offline LLM: the same input
path, scheduler and output path as served requests, on a tiny model."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public_requests import PromptCache

from tests.engine.helpers import assert_all_free, make_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def test_a_pinned_prefix_survives_a_flood_and_usage_says_so(tiny_llama):
    llm = make_llm(tiny_llama, num_blocks=16)  # 8-token blocks, no CPU tier
    pinned, unpinned = random_prompts([32, 32], seed=11)
    first = llm.generate([pinned + [40]], GREEDY, cache={"prefix_tokens": 32})[0]
    llm.generate([unpinned + [40]], GREEDY)
    assert first.num_cache_write_tokens == 32 and first.num_cached_tokens == 0
    for flood in random_prompts([80] * 4, seed=12):  # 11 blocks each: the cache turns over
        llm.generate([flood], GREEDY)
    assert llm.stats()["num_pinned_blocks"] == 4
    again = llm.generate([pinned + [41]], GREEDY, cache=PromptCache(prefix_tokens=32))[0]
    other = llm.generate([unpinned + [41]], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.cached_tokens_by_tier == {"device": 32}
    assert again.num_cache_write_tokens == 0  # refreshed, not written
    assert other.num_cached_tokens == 0  # the unpinned prefix was evicted
    assert_all_free(llm)


def test_with_a_cpu_tier_pressure_demotes_the_pin(tiny_llama):
    llm = make_llm(tiny_llama, num_blocks=11, swap_space=1 << 20, max_pinned_fraction=1.0)
    system = random_prompts([32], seed=13)[0]
    first = llm.generate([system + [40]], GREEDY, cache={})[0]  # the whole prompt: 4 blocks
    assert first.num_cache_write_tokens == 32
    llm.generate(random_prompts([80], seed=14), GREEDY)  # needs all 11 blocks
    assert llm.stats()["num_pinned_evictions"] == 4
    again = llm.generate([system + [40]], GREEDY)[0]
    assert again.cached_tokens_by_tier == {"cpu": 32}
    assert llm.stats()["num_pinned_blocks"] == 4  # the pin came back with its content
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_free(llm)


def test_prefix_messages_pins_the_rendered_messages(tiny_llama):
    llm = make_llm(tiny_llama)
    system = {"role": "system", "content": "The quick brown fox jumps over the lazy dog. " * 4}
    messages = [system, {"role": "user", "content": "Once upon a time"}]
    head = llm.inputs.chat_ids([system], add_generation_prompt=False)
    whole = llm.apply_chat_template(messages)
    assert llm.inputs.pinned_prefix(PromptCache(prefix_messages=1), whole, messages) == len(head)
    out = llm.chat(messages, GREEDY, cache={"prefix_messages": 1, "ttl": 3600})[0]
    assert out.num_cache_write_tokens == len(head) // 8 * 8  # full blocks only
    assert_all_free(llm)


@pytest.mark.parametrize(
    "cache, match",
    [
        ({"prefix_tokens": 99}, "exceeds the prompt"),
        ({"prefix_tokens": 2, "prefix_messages": 1}, "at most one"),
        ({"prefix_messages": 1}, "only with messages"),
        ({"ttl": 0}, "cache"),
        ({"bogus": 1}, "cache"),
        (PromptCache(ttl=-1.0), "cache"),
    ],
)
def test_bad_cache_fields_are_typed_errors(tiny_llama, cache, match):
    llm = make_llm(tiny_llama)
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([[5, 6, 7, 8]], GREEDY, cache=cache)
    assert_all_free(llm)


def test_priority_is_accepted_and_checked(tiny_llama):
    llm = make_llm(tiny_llama)
    outs = llm.generate(random_prompts([9, 9], seed=15), GREEDY, priority=-3)
    assert all(o.finished for o in outs)
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate([[5, 6]], GREEDY, priority="high")
    assert_all_free(llm)


def test_a_demoted_pin_is_read_back_from_disk(tiny_llama, tmp_path):
    from tests.engine.kv.test_disk_tier import disk_llm

    with disk_llm(tiny_llama, tmp_path / "kv", max_pinned_fraction=1.0) as llm:
        system = random_prompts([40], seed=16)[0]  # 5 full blocks
        first = llm.generate([system], GREEDY, cache={"prefix_tokens": 32})[0]
        assert first.num_cache_write_tokens == 32
        for flood in random_prompts([124, 124, 124], seed=17):  # all 16 device blocks each
            llm.generate([flood], GREEDY)
        again = llm.generate([system], GREEDY)[0]
        assert again.num_cached_tokens == 32 and again.cached_tokens_by_tier == {"disk": 32}
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert llm.stats()["num_pinned_blocks"] == 4  # its pin came back with it
        assert_all_free(llm)
