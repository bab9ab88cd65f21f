"""The C sampling kernels (kernels/cpu/nucleus.c) against their twins, on the host's build and
AVX2's: the nucleus against a row sorted whole (kernels/reference.py top_k_top_p_ref), the
inverse-CDF draw against softmax, cumsum and searchsorted (draw_ref)."""

import pytest
import torch
from kvpager.kernels import cpu_sampling
from kvpager.kernels.reference import draw_ref, top_k_top_p_ref


@pytest.fixture(params=["native", "x86-64-v3"])
def library(request, monkeypatch):
    built = cpu_sampling.load(request.param)
    if built is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_sampling, "load", lambda march=None: built)
    return built


def _logits(rows, vocab, scale, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize(
    ("vocab", "scale"), [(49_152, 1.0), (49_152, 0.05), (1_000, 6.0), (37, 1.0)]
)
def test_it_keeps_what_the_sorted_twin_keeps(library, vocab, scale):
    """Flat rows (nuclei of thousands), peaked ones (a handful), a vocab under one vector."""
    logits = _logits(8, vocab, scale)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.1, 0.95, 0.7, 0.3, 0.999])
    out = cpu_sampling.top_p(logits, top_p)
    expected = top_k_top_p_ref(logits, None, top_p)
    assert out is not None
    assert torch.equal(out.isfinite(), expected.isfinite())
    assert torch.equal(out[out.isfinite()], logits[expected.isfinite()])


def test_banned_tokens_stay_banned_and_ties_go_to_the_lower_index(library):
    logits = torch.zeros(2, 64)
    logits[:, 10:] = float("-inf")  # ten equal survivors
    out = cpu_sampling.top_p(logits, torch.tensor([0.25, 0.05]))
    assert out[0].isfinite().nonzero().flatten().tolist() == [0, 1, 2]  # 0.3 reaches 0.25
    assert out[1].isfinite().nonzero().flatten().tolist() == [0]
    assert not out[:, 10:].isfinite().any()


def test_a_row_with_nothing_left_stays_empty(library):
    logits = torch.full((1, 100), float("-inf"))
    assert not cpu_sampling.top_p(logits, torch.tensor([0.9])).isfinite().any()


def test_it_declines_what_it_does_not_take(library):
    logits = _logits(2, 100, 1.0)
    assert cpu_sampling.top_p(logits.bfloat16(), torch.tensor([0.9, 0.9])) is None
    assert cpu_sampling.top_p(logits, torch.tensor([0.9, 1.0])) is None  # 1.0: keep all


def _consistent(logits, inv_temperature, u, drawn) -> None:
    """Each drawn token's interval of the twin's CDF (in float64) holds u times the total,
    to rounding, and it has mass: the inverse-CDF draw, whichever side of a boundary."""
    probs = (logits.double() * inv_temperature.double().unsqueeze(1)).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    before = torch.cat([torch.zeros(len(cdf), 1, dtype=cdf.dtype), cdf[:, :-1]], dim=1)
    rows = torch.arange(len(cdf))
    target = u.double() * cdf[:, -1]
    assert bool((probs[rows, drawn] > 0).all())
    assert bool((before[rows, drawn] <= target + 1e-5).all())
    assert bool((cdf[rows, drawn] >= target - 1e-5).all())


@pytest.mark.parametrize(
    ("vocab", "scale"), [(49_152, 1.0), (49_152, 8.0), (1_000, 3.0), (37, 1.0)]
)
def test_the_draw_takes_the_twins_tokens(library, vocab, scale):
    """Rows at several temperatures, many draws each: the twin's token but where u falls
    within rounding of a boundary (then a neighbour, still in u's interval)."""
    rows, draws = 8, 64
    logits = _logits(rows, vocab, scale).repeat(draws, 1)
    inv_temperature = torch.tensor([1.0, 0.5, 2.0, 1.3, 0.7, 1.0, 4.0, 0.25]).repeat(draws)
    u = torch.rand(rows * draws, generator=torch.Generator().manual_seed(1))
    drawn = cpu_sampling.draw(logits, inv_temperature, u)
    assert drawn is not None and drawn.dtype == torch.int64
    _consistent(logits, inv_temperature, u, drawn)
    same = (drawn == draw_ref(logits, inv_temperature, u)).float().mean()
    assert same > 0.98, f"only {same:.3f} of the draws match the twin's"


def test_the_draw_never_takes_a_banned_token_and_covers_the_ends(library):
    """-inf tokens (a filter's, a grammar's) are never drawn, u = 0 takes the first token
    with mass and u near 1 the last, across a vocab that ends inside a block."""
    vocab = 1_000
    logits = torch.full((5, vocab), float("-inf"))
    kept = torch.tensor([3, 260, 511, 512, 999])
    logits[:, kept] = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0])
    u = torch.tensor([0.0, 0.3, 0.6, 0.9, 1.0 - 2**-24])
    drawn = cpu_sampling.draw(logits, torch.ones(5), u)
    assert drawn is not None
    assert set(drawn.tolist()) <= set(kept.tolist())
    assert drawn[0] == 3 and drawn[-1] == 999
    _consistent(logits, torch.ones(5), u, drawn)


def test_the_draw_declines_what_it_does_not_take(library):
    """Not fp32 or bf16, or rows whose logits are not adjacent: None, and the sampler keeps
    torch's path; shapes that disagree: an error."""
    logits = _logits(4, 64, 1.0)
    ones, u = torch.ones(4), torch.rand(4)
    assert cpu_sampling.draw(logits.half(), ones, u) is None
    assert cpu_sampling.draw(logits.t().contiguous().t(), ones, u) is None
    with pytest.raises(ValueError, match="for 4 rows"):
        cpu_sampling.draw(logits, torch.ones(3), u)


@pytest.mark.parametrize("vocab", [49_152, 1_000, 37])
def test_bf16_rows_draw_what_their_float_values_draw(library, vocab):
    """bf16 logits (widened a row at a time in the kernel) draw the very tokens their float32
    values draw, -inf tokens never, and a row past the vector lanes' end keeps its tail."""
    rows, draws = 8, 16
    logits = _logits(rows, vocab, 4.0).bfloat16().repeat(draws, 1)
    logits[:, 5] = float("-inf")
    inv_temperature = torch.tensor([1.0, 0.5, 2.0, 1.3, 0.7, 1.0, 4.0, 0.25]).repeat(draws)
    u = torch.rand(rows * draws, generator=torch.Generator().manual_seed(2))
    drawn = cpu_sampling.draw(logits, inv_temperature, u)
    assert drawn is not None
    assert torch.equal(drawn, cpu_sampling.draw(logits.float(), inv_temperature, u))
    assert not (drawn == 5).any()
    _consistent(logits.float(), inv_temperature, u, drawn)
