"""Draft-model speculation: a smaller model of the same vocabulary proposes, the target
verifies. Greedy outputs equal plain decoding, seeded samples are the same tokens, the draft's
K/V rides in the target's blocks (so the accounting is the scheduler's usual one), and every
block is free after each test.

The well-matched draft is the `looping` target cut to its first layer (its greedy tokens are
mostly the target's); the stranger is a differently seeded one-layer model, which is rarely
right, so rejections and their rollback are exercised too; the blurred one (the truncated
draft with a noisy lm_head) is right less often, for the distribution test.
"""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.worker.sampling import step_sampling
from kvpager.schemas.errors import ConfigError
from transformers import LlamaForCausalLM

from tests.engine.helpers import assert_all_free, make_llm
from tests.engine.worker.spec_decode.test_spec_decode import (  # noqa: F401 (fixtures)
    GREEDY,
    _prompts,
    _tokens,
    expected,
    looping,
)
from tests.engine.worker.spec_decode.test_spec_distribution import (
    assert_keeps_the_distribution,
)
from tests.models import build_llama, build_qwen2, build_truncated


@pytest.fixture(scope="module")
def truncated(looping, tmp_path_factory):  # noqa: F811
    return build_truncated(looping, tmp_path_factory.mktemp("draft-truncated"))


@pytest.fixture(scope="module")
def blurred(truncated, tmp_path_factory):
    """The truncated draft with a noisy lm_head: accepted between 10% and 90%, so both verdicts
    and the residual's shape matter."""
    path = tmp_path_factory.mktemp("draft-blurred")
    model = LlamaForCausalLM.from_pretrained(truncated)
    with torch.no_grad():
        weight = model.lm_head.weight
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        weight.add_(noise * weight.std() * BLUR)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("draft-stranger"), seed=7, num_hidden_layers=1)


BLUR = 0.5


def draft(path, k: int = 4, **more) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **more}


@pytest.mark.parametrize("which", ["truncated", "stranger"])
def test_greedy_identical_batched_and_alone(looping, expected, which, request):  # noqa: F811
    path = request.getfixturevalue(which)
    llm = make_llm(looping, speculative_config=draft(path))
    assert _tokens(llm, _prompts(), GREEDY) == expected
    alone = [_tokens(llm, [prompt], GREEDY)[0] for prompt in _prompts()]
    assert alone == expected
    stats = llm.stats()
    accepted = stats["spec_decode_num_accepted_tokens"]
    drafted = stats["spec_decode_num_draft_tokens"]
    if which == "truncated":
        assert accepted > 0.5 * drafted > 50, stats  # a good draft is mostly right
        assert stats["num_steps"] < 0.6 * 2 * sum(map(len, expected)), stats
    else:
        assert drafted > accepted, stats  # rejections happened and were rolled back
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_identical_under_preemption(looping, expected, truncated, mode):  # noqa: F811
    llm = make_llm(
        looping, speculative_config=draft(truncated), num_blocks=24, preemption_mode=mode,
        plan_ahead=0,
    )  # fmt: skip
    assert _tokens(llm, _prompts(), GREEDY) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert_all_free(llm)


def test_seeded_samples_and_parallel_samples_match(looping, expected, truncated):  # noqa: F811
    base, llm = make_llm(looping), make_llm(looping, speculative_config=draft(truncated, k=3))
    prompts = _prompts()[:3]
    seeded = [
        SamplingParams(temperature=t, seed=s, max_tokens=32, ignore_eos=True)
        for s, t in ((1, 0.6), (2, 1.0), (3, 0.3))
    ]
    assert _tokens(llm, prompts, seeded) == _tokens(base, prompts, seeded)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=3)
    outs = llm.generate(_prompts()[:2], params, use_tqdm=False)
    for out, want in zip(outs, expected):
        assert [o.token_ids for o in out.outputs] == [want] * 3
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_free(llm)


def test_draft_steps_aside_for_a_large_batch(looping, expected, truncated):  # noqa: F811
    llm = make_llm(looping, speculative_config=draft(truncated, max_num_seqs_to_speculate=2))
    lengths = [48, 48, 12, 16, 20]  # 5 running: off until 2 are left
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert _tokens(llm, _prompts(), params) == [t[:n] for t, n in zip(expected, lengths)]
    assert 0 < llm.scheduler.lookahead.stats.num_drafts < 48
    assert not llm.executor.proposer._computed  # every finished request forgotten
    assert_all_free(llm)


def test_draft_slots_share_the_blocks(looping, truncated):  # noqa: F811
    """The draft's layer slots follow the target's in one cache tensor, the same block ids;
    its scratch blocks sit past the scheduler's pool."""
    llm = make_llm(looping, speculative_config=draft(truncated, k=9), num_blocks=64)
    cache = llm.executor.kv_cache
    assert cache.shape[0] == 2 + 1 and cache.shape[2] == 64
    # 2 blocks a speculating sequence for k = 9 over 8-token blocks
    scratch = 2 * min(8, llm.executor.config.max_num_seqs)
    assert llm.stats()["num_blocks"] == 64 - scratch
    assert llm.executor.proposer.scratch_ids == list(range(64 - scratch, 64))


def test_memory_budget_counts_the_draft(looping, truncated):  # noqa: F811
    budget = 2**20
    plain = make_llm(looping, num_blocks=None, kv_cache_memory=budget)
    spec = make_llm(
        looping, num_blocks=None, kv_cache_memory=budget, speculative_config=draft(truncated)
    )
    # 2 target layers + 1 draft layer a block: two thirds as many blocks in the same bytes
    assert spec.executor.kv_cache.shape[2] == plain.executor.kv_cache.shape[2] * 2 // 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda tmp: tmp, "no config.json"),
        (lambda tmp: build_qwen2(tmp), "differ from the target"),
    ],
)
def test_bad_draft_is_refused(looping, tmp_path, make, match):  # noqa: F811
    with pytest.raises(ConfigError, match=match):
        make_llm(looping, speculative_config=draft(make(tmp_path)))


def test_sampled_drafts_keep_the_distribution(looping, blurred, monkeypatch):  # noqa: F811
    """Unseeded random rows: the draft samples from q and rejection.py's rule decides; the
    histograms of the tokens proposals decide match plain sampling's (chi-square). Checked to
    fail (p ~ 1e-5 and below) with a rejection resampled from p instead of the residual, and
    with acceptance at p(x) instead of min(1, p(x) / q(x))."""
    calls = []
    real = step_sampling.accept_sampled_drafts
    monkeypatch.setattr(
        step_sampling, "accept_sampled_drafts", lambda *a: calls.append(1) or real(*a)
    )
    assert_keeps_the_distribution(looping, draft(blurred, k=3, max_num_seqs_to_speculate=4096))
    assert calls  # the rule with q decided


def test_draft_config_as_vllm_writes_it(truncated):
    from kvpager.engine.config import SpeculativeConfig

    config = SpeculativeConfig.parse(f'{{"model": "{truncated}", "num_speculative_tokens": 3}}')
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        str(truncated),
        3,
    )
    assert SpeculativeConfig.parse(config.to_json()) == config  # as it crosses to executors
