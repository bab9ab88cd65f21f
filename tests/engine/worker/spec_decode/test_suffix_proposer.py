"""Suffix decoding's proposer: the longest match, the most frequent continuation, the
probability threshold and adaptive length, the cross-request cache and its LRU bound."""

import numpy as np
import pytest
from kvpager.engine.config import SpeculativeConfig
from kvpager.engine.worker.spec_decode.suffix_match import DraftLimits, best_draft, walk
from kvpager.engine.worker.spec_decode.suffix_proposer import SuffixProposer


def proposer(**fields) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", **fields))


def ids(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def propose(tokens, k=8, **fields) -> list[int]:
    return proposer(**fields).propose(ids(tokens), k)


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    # "1 2 3" occurred followed by 4 5 6; "3" alone more recently, followed by 9
    tokens = [1, 2, 3, 4, 5, 6, 7, 3, 9, 1, 2, 3]
    assert propose(tokens) == [4, 5, 6]  # factor 1: at most 3 tokens after a 3-token match
    assert propose(tokens, suffix_decoding_max_spec_factor=2.0) == [4, 5, 6, 7, 3, 9]
    assert propose(tokens, k=2) == [4, 5]


def test_the_most_frequent_continuation_and_the_probability_threshold():
    # after "7": 8 twice, 9 once; every path probability is counted against all occurrences
    tokens = [7, 8, 1, 7, 9, 2, 7, 8, 3, 7]
    assert propose(tokens, k=1) == [8]
    assert propose(tokens, k=1, suffix_decoding_min_token_prob=0.7) == []  # p(8) = 2/3
    # after "7 8": 1 once, 3 once (the most recent wins a tie), p = 2/3 * 1/2
    assert propose(tokens, k=2, suffix_decoding_max_spec_factor=2.0) == [8, 3]
    few = {"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.4}
    assert propose(tokens, k=2, **few) == [8]


def test_tree_depth_bounds_the_match():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert propose(tokens) == [5, 6, 1, 2]  # a 4-token match: up to 4 tokens
    assert propose(tokens, suffix_decoding_max_tree_depth=2) == [5, 6]


def test_no_match_proposes_nothing():
    assert propose([5, 6, 7]) == []
    assert propose([]) == [] and propose([3, 3], k=0) == []
    assert propose([4, 4]) == [4]  # "4" at 0 was followed by 4


def test_outputs_of_earlier_requests_are_reused():
    suffix = proposer()
    earlier = ids([50, 10, 11, 12, 13, 14, 15, 16, 17])
    suffix.cache.add("earlier", earlier)
    # the new sequence has never seen 13 follow 12 itself
    assert suffix.propose(ids([90, 91, 10, 11, 12]), 8) == [13, 14, 15]
    # its own text wins when it scores higher: p = 1 there, 1/2 in the cache (13 or 60)
    suffix.cache.add("other", ids([10, 11, 12, 60]))
    own = ids([10, 11, 12, 40, 41, 42, 99, 10, 11, 12])
    assert suffix.propose(own, 3) == [40, 41, 42]
    assert suffix.propose(ids([99, 10, 11, 12]), 3) == [60]  # the most recent of a tie


def test_matches_never_cross_from_one_cached_output_into_the_next():
    suffix = proposer()
    suffix.cache.add("a", ids([1, 2, 3]))
    suffix.cache.add("b", ids([4, 5, 6]))
    assert suffix.propose(ids([9, 2, 3]), 4) == []  # 3 ends "a": nothing follows it
    assert suffix.propose(ids([9, 4, 5]), 4) == [6]


def test_the_cache_is_bounded_and_evicts_the_least_recently_used():
    suffix = proposer(suffix_decoding_max_cached_requests=2)
    suffix.cache.add("a", ids([1, 2, 3, 4]))
    suffix.cache.add("b", ids([5, 6, 7, 8]))
    assert suffix.propose(ids([0, 1, 2]), 4) == [3, 4]  # a draft from "a" touches it
    suffix.cache.add("c", ids([9, 10, 11]))  # evicts "b", the least recently used
    assert len(suffix.cache) == 2
    assert suffix.propose(ids([0, 5, 6]), 4) == []
    assert suffix.propose(ids([0, 1, 2]), 4) == [3, 4]
    suffix.cache.add("a", ids([1, 2, 30]))  # the same sequence again replaces its output
    assert suffix.propose(ids([0, 1, 2]), 4) == [30]
    none = proposer(suffix_decoding_max_cached_requests=0)
    none.cache.add("a", ids([1, 2, 3]))
    assert len(none.cache) == 0 and none.propose(ids([0, 1, 2]), 4) == []


def test_walk_stops_at_the_end_of_the_tokens():
    draft = walk(ids([1, 2, 3]), ids([0]), 5, 0.0)
    assert draft.token_ids == [2, 3] and draft.score == 2.0
    limits = DraftLimits(max_tokens=4, max_depth=8, max_spec_factor=1.0, min_token_prob=0.1)
    assert best_draft(ids([1]), ids([1]), limits).token_ids == []


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"suffix_decoding_max_tree_depth": 0}, "max_tree_depth"),
        ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
        ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
        ({"suffix_decoding_min_token_prob": "0.1"}, "numbers"),
        ({"min_acceptance_rate": -0.1}, "min_acceptance_rate"),
        ({"num_speculative_tokens": 33}, "num_speculative_tokens"),
        ({"disable_by_batch_size": 4, "max_num_seqs_to_speculate": 5}, "differ"),
    ],
)
def test_bad_suffix_config(fields, match):
    from kvpager.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.parse({"method": "suffix", **fields})


def test_suffix_config_defaults_follow_vllm():
    config = SpeculativeConfig.parse({"method": "suffix", "disable_by_batch_size": 4})
    assert config.num_speculative_tokens == 24 == config.suffix_decoding_max_tree_depth
    assert config.max_num_seqs_to_speculate == 4
    assert SpeculativeConfig.parse(config.to_json()) == config
    assert SpeculativeConfig.parse({"method": "ngram"}).num_speculative_tokens == 4


def test_the_cache_index_agrees_with_a_scan_through_evictions_and_compaction(monkeypatch):
    from kvpager.engine.worker.spec_decode import suffix_cache

    monkeypatch.setattr(suffix_cache, "MIN_UNINDEXED", 8)  # index early and often
    cache, kept = suffix_cache.SuffixCache(max_requests=5), {}
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq_id = f"s{rng.integers(0, 12)}"  # ids come back: the later output replaces
        output = rng.integers(0, 20, rng.integers(1, 30))
        cache.add(seq_id, output)
        kept.pop(seq_id, None)
        kept[seq_id] = output.tolist()
        while len(kept) > 5:
            kept.pop(next(iter(kept)))
        tokens = cache.tokens()
        for token in range(20):
            assert cache.ends_of(token).tolist() == np.flatnonzero(tokens == token).tolist()
        live = {s: tokens[start : start + n].tolist() for s, (start, n) in cache._where.items()}
        assert live == kept and list(cache._where) == list(kept)
    assert cache._num_indexed > 0 and len(tokens) < 5 * 2 * 31 * 2  # compacted


@pytest.mark.parametrize("small", [0, 3, 10_000])  # column by column, mixed, all at once
def test_match_lengths_agree_with_their_definition(monkeypatch, small):
    from kvpager.engine.worker.spec_decode import suffix_match

    monkeypatch.setattr(suffix_match, "SMALL", small)
    rng = np.random.default_rng(small)
    for _ in range(50):
        tokens = rng.integers(0, 3, rng.integers(2, 80))
        tokens[rng.random(tokens.size) < 0.05] = suffix_match.SEPARATOR
        context = rng.integers(0, 3, rng.integers(1, 12))
        depth = int(rng.integers(1, 10))
        ends, lengths = suffix_match.match_ends(tokens, context, depth)
        want = {}
        for end in range(len(tokens) - 1):
            if tokens[end] == context[-1] and tokens[end + 1] != suffix_match.SEPARATOR:
                n = 1
                while n < min(depth, len(context)) and end - n >= 0:
                    if tokens[end - n] != context[-1 - n]:
                        break
                    n += 1
                want[end] = n
        assert dict(zip(ends.tolist(), lengths.tolist())) == want
