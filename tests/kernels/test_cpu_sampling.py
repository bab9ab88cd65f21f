"""The C nucleus kernel (kernels/cpu/nucleus.c) against its twin, a row sorted whole
(kernels/reference.py top_k_top_p_ref), on the host's build and AVX2's."""

import pytest
import torch
from kvpager.kernels import cpu_sampling
from kvpager.kernels.reference import top_k_top_p_ref


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
