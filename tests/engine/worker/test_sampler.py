"""Sampler: each stage against a direct computation on small known logits."""

import math

import pytest
import torch
from kvpager.engine.worker.sampling.batch import SamplingBatch
from kvpager.engine.worker.sampling.sampler import Sampler, SamplerOutput
from kvpager.schemas.sampling import SamplingParams

CPU = torch.device("cpu")
EOS = 3
# softmax of these is exactly [0.5, 0.25, 0.15, 0.1]
KNOWN_PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])
KNOWN_LOGITS = KNOWN_PROBS.log()
NUM_DRAWS = 20_000


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seed_positions: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    num_rows = len(params)
    batch = SamplingBatch.build(
        params,
        seed_positions or [0] * num_rows,
        prompts or [[] for _ in range(num_rows)],
        outputs or [[] for _ in range(num_rows)],
        eos_token_ids=[EOS],
        vocab_size=logits.shape[1],
        device=CPU,
    )
    return Sampler()(logits, batch)


def frequencies(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Empirical distribution of NUM_DRAWS samples of one row (drawn as one big batch)."""
    torch.manual_seed(0)
    logits = logits_row.expand(NUM_DRAWS, -1)
    tokens = sample(logits, [params] * NUM_DRAWS).sampled_token_ids
    return torch.bincount(tokens, minlength=logits.shape[1]).float() / NUM_DRAWS


def assert_distribution(freqs: torch.Tensor, expected: torch.Tensor) -> None:
    """Tokens of zero probability never drawn; the others within ~6 standard deviations."""
    assert torch.equal(freqs > 0, expected > 0), (freqs, expected)
    torch.testing.assert_close(freqs, expected, atol=0.02, rtol=0)


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams()]
    out = sample(logits, params)
    assert out.sampled_token_ids[:2].tolist() == [1, 0]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_takes_the_first_of_equal_maxima_across_a_wide_row() -> None:
    """Rows as wide as a real vocab, with many equal maxima anywhere in them (the vectorised
    reduction works in lanes: the lowest index must still win)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(0, 3, (16, 49_152), generator=gen).float()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    first_max = (logits == logits.amax(dim=-1, keepdim=True)).int().argmax(dim=-1)
    assert torch.equal(out.sampled_token_ids, first_max)


def test_greedy_rows_ignore_random_rows_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_p=0.9) for i in range(64)]
    out = sample(logits, params)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(dim=-1))


@pytest.mark.parametrize("repetition_penalty", [1.5, 1.0])  # edits to a copy, or no copy
def test_input_logits_are_not_modified(repetition_penalty) -> None:
    logits = torch.randn(3, 10)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=3, min_p=0.1, repetition_penalty=repetition_penalty)
    ] * 3
    sample(logits, params, outputs=[[1, 2], [3], []])
    assert torch.equal(logits, before)


def test_temperature_scales_the_distribution() -> None:
    freqs = frequencies(KNOWN_LOGITS, SamplingParams(temperature=2.0))
    assert_distribution(freqs, torch.softmax(KNOWN_LOGITS / 2.0, dim=-1))


def test_plain_sampling_follows_softmax() -> None:
    assert_distribution(frequencies(KNOWN_LOGITS, SamplingParams()), KNOWN_PROBS)


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_k=100), [0, 1, 2, 3]),  # larger than the vocabulary: no-op
        (SamplingParams(top_p=0.7), [0, 1]),  # 0.5 < 0.7 <= 0.75
        (SamplingParams(top_p=0.8), [0, 1, 2]),
        (SamplingParams(top_p=0.4), [0]),
        (SamplingParams(min_p=0.4), [0, 1]),  # threshold 0.2
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # threshold 0.15: 0.15 is kept
        (SamplingParams(top_k=3, top_p=0.6), [0, 1]),  # top_p over {0.5, 0.25, 0.15} / 0.9
        (SamplingParams(min_p=0.25, top_k=2), [0, 1]),
    ],
)
def test_filters_keep_the_expected_tokens(params: SamplingParams, kept: list[int]) -> None:
    expected = torch.zeros(4)
    expected[kept] = KNOWN_PROBS[kept] / KNOWN_PROBS[kept].sum()
    assert_distribution(frequencies(KNOWN_LOGITS, params), expected)


def test_filters_apply_after_temperature() -> None:
    # At temperature 2 the probabilities flatten to ~[0.36, 0.25, 0.20, 0.16]: min_p 0.5 keeps 3.
    params = SamplingParams(temperature=2.0, min_p=0.5)
    scaled = torch.softmax(KNOWN_LOGITS / 2.0, dim=-1)
    expected = torch.where(scaled >= 0.5 * scaled.max(), scaled, 0.0)
    assert_distribution(frequencies(KNOWN_LOGITS, params), expected / expected.sum())


def test_per_row_filters_in_one_batch() -> None:
    torch.manual_seed(2)
    logits = KNOWN_LOGITS.expand(3000, -1)
    params = [SamplingParams(top_k=1 + i % 3) for i in range(3000)]
    tokens = sample(logits, params).sampled_token_ids
    top_k = torch.tensor([1 + i % 3 for i in range(3000)])
    assert bool((tokens < top_k).all())


def test_logprobs_are_log_softmax_before_temperature() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 12)
    params = [
        SamplingParams(temperature=0.5, top_k=4, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(),
    ]
    out = sample(logits, params)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_logprob_ids is not None
    rows = torch.arange(3)
    torch.testing.assert_close(out.logprobs, expected[rows, out.sampled_token_ids])
    best, best_ids = expected.sort(dim=-1, descending=True)
    assert out.top_logprobs.shape == (3, 5) and out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.top_logprobs, best[:, :5])
    assert torch.equal(out.top_logprob_ids, best_ids[:, :5])


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    out = sample(torch.randn(2, 6), [SamplingParams(logprobs=0)] * 2)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_logprobs.shape == (2, 0)


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0, logprobs=0)]
    out = sample(logits, params, prompts=[[1, 1]], outputs=[[2, 4]])
    expected = torch.tensor([2.0, 0.5, -2.0, 0.5, 1.5])
    assert out.sampled_token_ids.tolist() == [0]  # 4 was the argmax before the penalty
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(expected, dim=-1)[[0]])


def test_frequency_and_presence_penalties_over_output_only() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0, 3.0], [1.0, 2.0, 0.0, 3.0]])
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.75, logprobs=4),
        SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=4),
    ]
    out = sample(logits, params, prompts=[[0, 0], [0, 0]], outputs=[[3, 3, 1], [3, 3, 1]])
    expected = torch.tensor([[1.0, 1.25, 0.0, 1.5], [1.0, 0.5, 0.0, 1.5]])
    assert out.sampled_token_ids.tolist() == [3, 3]
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    got = torch.empty(2, 4).scatter_(1, out.top_logprob_ids, out.top_logprobs)
    torch.testing.assert_close(got, torch.log_softmax(expected, dim=-1))


def test_negative_penalties_encourage() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.9]])
    params = [SamplingParams(temperature=0.0, presence_penalty=-0.5)]
    assert sample(logits, params, outputs=[[2]]).sampled_token_ids.tolist() == [2]


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0]] * 4)  # EOS (3) then stop token 2 lead
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], logprobs=0),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[99]),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[3]),
    ]
    out = sample(logits, params, outputs=[[0], [0, 1], [], []])
    assert out.sampled_token_ids.tolist() == [1, 3, 3, 2]
    assert out.logprobs is not None and math.isfinite(out.logprobs[0].item())


def test_min_tokens_holds_for_random_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0]]).expand(500, -1)
    params = [SamplingParams(min_tokens=1)] * 500
    assert EOS not in sample(logits, params).sampled_token_ids.tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 40
    torch.manual_seed(4)
    steps = [torch.randn(1, vocab) for _ in range(6)]
    seeded = SamplingParams(seed=7, temperature=0.9, top_p=0.95)

    def run(num_others: int, row: int) -> list[int]:
        tokens = []
        for position, step_logits in enumerate(steps):
            logits = torch.randn(num_others + 1, vocab)
            logits[row] = step_logits[0]
            params = [SamplingParams(temperature=1.5)] * (num_others + 1)
            params[row] = seeded
            positions = [0] * (num_others + 1)
            positions[row] = position
            out = sample(logits, params, positions)
            tokens.append(int(out.sampled_token_ids[row]))
        return tokens

    alone = run(0, 0)
    assert run(5, 3) == alone
    assert run(9, 9) == alone
    assert len(set(alone)) > 1  # really random, not greedy


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.zeros(2, 1000)  # uniform: 1000 equally likely tokens
    params = [SamplingParams(seed=1), SamplingParams(seed=1)]
    same = sample(logits, params, [0, 0]).sampled_token_ids.tolist()
    assert same[0] == same[1]
    other = [SamplingParams(seed=2), SamplingParams(seed=1)]
    different = sample(logits, other, [0, 0]).sampled_token_ids.tolist()
    assert different[0] != different[1]


def test_a_seeded_draw_depends_on_seed_and_position_only() -> None:
    """Resuming at output position k (a migrated stream) draws what an unbroken run drew."""
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=5)]
    unbroken = [int(sample(logits, params, [k]).sampled_token_ids[0]) for k in range(8)]
    torch.manual_seed(123)  # the global generator plays no part in seeded rows
    resumed = [int(sample(logits, params, [k]).sampled_token_ids[0]) for k in range(3, 8)]
    assert resumed == unbroken[3:]
    assert len(set(unbroken)) > 4  # positions give unrelated draws


def test_flags_skip_unused_stages() -> None:
    greedy = SamplingBatch.build(
        [SamplingParams(temperature=0.0, top_k=5)], [0], [[1]], [[2]], [EOS], 10, CPU
    )
    assert greedy.all_greedy and greedy.no_penalties and greedy.no_top_k_p
    assert greedy.min_p is None and greedy.banned_rows is None
    assert greedy.max_num_logprobs is None
    mixed = SamplingBatch.build(
        [SamplingParams(top_p=0.5), SamplingParams(temperature=0.0, frequency_penalty=1.0)],
        [0, 0],
        [[1], [1]],
        [[2], [2]],
        [EOS],
        10,
        CPU,
    )
    assert not mixed.all_greedy and not mixed.no_penalties and not mixed.no_top_k_p
    assert mixed.top_k is None
    assert mixed.greedy_mask.tolist() == [False, True]


def test_logit_bias_is_added_before_greedy_and_logprobs() -> None:
    logits = KNOWN_LOGITS.expand(3, -1).clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}, logprobs=1),  # forced
        SamplingParams(temperature=0.0, logit_bias={0: -100.0}, logprobs=1),  # banned: next best
        SamplingParams(temperature=0.0, logprobs=1),  # untouched in the same batch
    ]
    out = sample(logits, params)
    assert out.sampled_token_ids.tolist() == [3, 1, 0]
    biased = KNOWN_LOGITS.clone()
    biased[3] += 100.0
    expected = biased.log_softmax(-1)[3].item()
    assert math.isclose(out.logprobs[0].item(), expected, abs_tol=1e-5)
    assert math.isclose(out.logprobs[2].item(), math.log(0.5), abs_tol=1e-5)


def test_logit_bias_forces_a_random_row_and_ignores_ids_past_the_logits() -> None:
    params = SamplingParams(temperature=1.0, logit_bias={2: 100.0, 99: 5.0})
    freqs = frequencies(KNOWN_LOGITS, params)
    assert freqs[2].item() == 1.0


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: float("nan")}, {-1: 1.0}])
def test_logit_bias_out_of_range_is_refused(bias) -> None:
    from kvpager.schemas.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"


@pytest.mark.parametrize(
    "extra",
    [
        {},  # plain rows: bf16 straight to argmax and the C draw
        {"top_p": 0.9},  # filtered: through float32
        {"logprobs": 2},
        {"repetition_penalty": 1.3},
    ],
)
def test_bf16_logits_sample_as_their_float_values(extra) -> None:
    """A bf16 model's logits, kept bf16 where nothing edits them, give the tokens (and
    logprobs) of the same values in float32: greedy and seeded random rows in one batch."""
    logits = (torch.randn(6, 4_000, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    params = [
        SamplingParams(temperature=0.0, **extra),
        SamplingParams(temperature=1.0, seed=11, **extra),
        SamplingParams(temperature=0.7, seed=12, **extra),
        SamplingParams(temperature=0.0, **extra),
        SamplingParams(temperature=1.3, seed=13, **extra),
        SamplingParams(temperature=1.0, seed=14, **extra),
    ]
    prompts = [[7, 8, 9]] * 6
    got = sample(logits, params, seed_positions=[5] * 6, prompts=prompts)
    want = sample(logits.float(), params, seed_positions=[5] * 6, prompts=prompts)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    if extra.get("logprobs") is not None:
        assert torch.equal(got.logprobs, want.logprobs)
