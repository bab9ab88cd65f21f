"""The seeded workloads `kvpager bench` and the developer benchmarks send: token-id prompts
without special ids, fixed output lengths, Poisson arrival times."""

import math

from kvpager.services.bench.workloads import (
    TokenSource,
    Workload,
    arrival_times,
    multi_prefix,
    parallel_sampling,
    uniform,
)


def test_workloads_are_seeded_and_avoid_special_ids():
    source = TokenSource(vocab_size=50, special_ids=frozenset(range(10)))
    first = uniform(source, 6, (4, 20), (3, 9), seed=1)
    assert first == uniform(source, 6, (4, 20), (3, 9), seed=1)
    assert all(10 <= t < 50 for r in first.requests for t in r.prompt_token_ids)
    assert all(3 <= r.max_tokens <= 9 for r in first.requests)
    parallel = parallel_sampling(source, 2, 4, (4, 8), (3, 5), seed=2)
    assert parallel.num_output_tokens == 4 * sum(r.max_tokens for r in parallel.requests)
    assert Workload.from_json(parallel.to_json()) == parallel


def test_multi_prefix_interleaves_systems_each_with_its_users():
    source = TokenSource(vocab_size=500, special_ids=frozenset(range(10)))
    workload = multi_prefix(source, 3, 4, 32, (5, 9), 7, seed=1)
    assert workload == multi_prefix(source, 3, 4, 32, (5, 9), 7, seed=1)
    assert len(workload.requests) == 12 and {r.max_tokens for r in workload.requests} == {7}
    systems = [tuple(r.prompt_token_ids[:32]) for r in workload.requests]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert all(5 <= len(r.prompt_token_ids) - 32 <= 9 for r in workload.requests)
    assert all(10 <= t < 500 for r in workload.requests for t in r.prompt_token_ids)
    assert systems != sorted(systems, key=systems.index)  # not grouped by system: shuffled


def test_arrival_times_are_seeded_poisson_or_all_at_once():
    times = arrival_times(2000, rate=4.0, seed=3)
    assert times == arrival_times(2000, rate=4.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert 0.9 < len(times) / times[-1] / 4.0 < 1.1  # about 4 requests a second
    assert arrival_times(5, math.inf, seed=3) == [0.0] * 5
