"""The speculative-sampling rule with a draft distribution q keeps the target's p.

On a 6-token vocabulary, with p and q far apart: 20,000 runs of two proposals drawn from q,
the first emitted token's histogram must match p_0 and the second's, after an accepted first
proposal, p_1, within a total-variation bound. Two broken rules (resampling a rejection from
p instead of the residual; accepting with p(x) instead of min(1, p(x) / q(x))) break that
bound by far, so the test can fail.
"""

from collections import Counter

import pytest
import torch
from kvpager.engine.worker.spec_decode.rejection import rejection_sample, samples_drafts
from kvpager.schemas.sampling import SamplingParams

VOCAB, NUM_RUNS, BOUND = 6, 20_000, 0.025


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(3, VOCAB, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(2, VOCAB, generator=gen) * 1.5).softmax(-1)
    return p, q


def _broken_residual(p, q, drafts, bonus, generator):
    d = len(drafts)
    u = torch.rand(d, generator=generator, dtype=torch.float64).tolist()
    for j in range(d):
        if u[j] * float(q[j, drafts[j]]) < float(p[j, drafts[j]]):
            continue
        return drafts[:j] + [int(torch.multinomial(p[j], 1, generator=generator))]
    return drafts + [bonus]


def _broken_accept(p, q, drafts, bonus, generator):
    d = len(drafts)
    u = torch.rand(d, generator=generator, dtype=torch.float64).tolist()
    for j in range(d):
        if u[j] < float(p[j, drafts[j]]):
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [bonus]


def _distances(rule, seed: int) -> tuple[float, float]:
    """Total variation of the 1st emitted token from p_0, of the 2nd (after an accepted 1st
    proposal) from p_1."""
    p, q = _rows(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    drafts = torch.multinomial(q, NUM_RUNS, replacement=True, generator=gen).T.tolist()
    bonuses = torch.multinomial(p[2], NUM_RUNS, replacement=True, generator=gen).tolist()
    first, second = Counter(), Counter()
    for pair, bonus in zip(drafts, bonuses):
        tokens = rule(p, q, pair, bonus, gen)
        first[tokens[0]] += 1
        if len(tokens) > 1:  # the first proposal was accepted
            second[tokens[1]] += 1
    return _tv(first, p[0]), _tv(second, p[1])


def _tv(counts: Counter, probs: torch.Tensor) -> float:
    total = sum(counts.values())
    return 0.5 * sum(abs(counts[t] / total - float(probs[t])) for t in range(VOCAB))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_keeps_the_target_distribution(seed):
    assert max(_distances(rejection_sample, seed)) < BOUND


@pytest.mark.parametrize("rule", [_broken_residual, _broken_accept])
def test_a_broken_rule_fails_the_bound(rule):
    assert max(max(_distances(rule, seed)) for seed in (0, 1, 2)) > 2 * BOUND


def test_one_hot_q_is_accept_while_equal():
    p, _ = _rows(3)
    q = torch.nn.functional.one_hot(torch.tensor([2, 4]), VOCAB).float()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):  # the residual of a one-hot q never holds the proposal
        tokens = rejection_sample(p, q, [2, 4], 5, gen)
        assert tokens == [2, 4, 5] or tokens[-1] != [2, 4][len(tokens) - 1]


def test_which_rows_sample_drafts():
    assert samples_drafts(SamplingParams(temperature=0.7))
    assert not samples_drafts(SamplingParams(temperature=0.0))
    assert not samples_drafts(SamplingParams(temperature=0.7, seed=3))
    assert not samples_drafts(SamplingParams(temperature=0.7, logprobs=1))
