"""Speculative sampling keeps the model's distribution: a two-sample chi-square test.

2,000 unseeded samples of 3 tokens each from one repetitive prompt, with and without n-gram
or suffix speculation (different engine seeds, so the draws are independent): the histograms of the
2nd and of the 3rd token must agree. Those tokens are the ones proposals decide (the 1st
comes from the prefill), so emitting a rejected proposal anyway, or sampling a rejection
from p instead of the residual, skews them towards the proposals and fails the test.
"""

import math
from collections import Counter

import pytest
from kvpager.engine import SamplingParams

from tests.engine.helpers import assert_all_free, make_llm
from tests.engine.worker.spec_decode.test_spec_decode import (  # noqa: F401 (a fixture)
    SPEC,
    SUFFIX,
    looping,
)

NUM_SAMPLES = 2000
TEMPERATURE = 0.5
START = [40, 41, 42, 43, 44, 45] * 2


def chi_square_p_value(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Two equal-sized samples from one distribution? Bins with fewer than `min_count`
    observations in all are pooled; the p-value by Wilson-Hilferty's normal approximation."""
    keys = sorted(set(a) | set(b))
    bins = [(a[k], b[k]) for k in keys if a[k] + b[k] >= min_count]
    rest = [(a[k], b[k]) for k in keys if a[k] + b[k] < min_count]
    if rest:
        bins.append((sum(x for x, _ in rest), sum(y for _, y in rest)))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins if x + y)
    df = len(bins) - 1
    if df < 1:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _histograms(llm, prompt: list[int]) -> tuple[Counter, Counter, Counter]:
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    return tuple(Counter(t[i] for t in tokens) for i in range(3))


@pytest.mark.parametrize("method", [SPEC, SUFFIX], ids=["ngram", "suffix"])
def test_speculative_sampling_keeps_the_distribution(looping, method):  # noqa: F811
    assert_keeps_the_distribution(looping, {**method, "max_num_seqs_to_speculate": 4096})


def assert_keeps_the_distribution(path, config: dict) -> None:
    """Plain and speculative sampling (`config`) agree on the 2nd and 3rd tokens, and both
    verdicts were common."""
    args = dict(block_size=16, num_blocks=4096, max_num_seqs=2048)
    base = make_llm(path, seed=1, **args)
    spec = make_llm(path, seed=2, speculative_config=config, **args)
    # the model's own greedy continuation repeats itself: proposals come from its loops
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = START + base.generate([START], greedy, use_tqdm=False)[0].outputs[0].token_ids
    want, got = _histograms(base, prompt), _histograms(spec, prompt)
    stats = spec.stats()
    accepted, drafted = (
        stats["spec_decode_num_accepted_tokens"],
        stats["spec_decode_num_draft_tokens"],
    )
    assert 0.1 * drafted < accepted < 0.9 * drafted, stats  # both verdicts are common
    for position in (1, 2):
        p_value = chi_square_p_value(want[position], got[position])
        assert p_value > 1e-3, (position, p_value, want[position], got[position])
    assert_all_free(spec)


def test_the_chi_square_test_can_fail():
    even = Counter({1: 500, 2: 500, 3: 500, 4: 500})
    skewed = Counter({1: 650, 2: 450, 3: 450, 4: 450})
    assert chi_square_p_value(even, Counter(dict(even))) == pytest.approx(1.0, abs=0.01)
    assert chi_square_p_value(even, skewed) < 1e-3
