"""Top-k / top-p over candidates (engine/worker/sampling/top_k_top_p.py) keep exactly the tokens the
sorted definition keeps, on rows the candidates settle and on rows sorted whole."""

import pytest
import torch
from kvpager.engine.worker.sampling import top_k_top_p as filters
from kvpager.engine.worker.sampling.top_k_top_p import CANDIDATES, top_k_top_p
from kvpager.kernels.reference import top_k_top_p_ref as top_k_top_p_sorted

VOCAB = 2_000


def _rows(scale: float, rows: int = 12, seed: int = 0) -> torch.Tensor:
    """Logits as peaked (scale 4: the nucleus a handful) or flat (scale 0.1) as asked."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _same_kept(fast: torch.Tensor, sorted_: torch.Tensor) -> None:
    assert torch.equal(fast.isfinite(), sorted_.isfinite())
    assert torch.equal(fast[fast.isfinite()], sorted_[sorted_.isfinite()])


@pytest.mark.parametrize("scale", [4.0, 0.1])  # candidates settle it / rows sorted whole
@pytest.mark.parametrize(
    ("ks", "ps"),
    [
        (None, [0.9, 0.5, 0.99]),
        ([5, 40, VOCAB], None),
        ([CANDIDATES + 10, 3, VOCAB], [0.8, 1.0, 0.95]),  # a top_k past the candidates
        ([VOCAB, VOCAB, 7], [1.0, 0.7, 1.0]),  # rows left untouched among filtered ones
    ],
)
def test_the_kept_tokens_are_the_sorted_filters(scale, ks, ps):
    logits = _rows(scale)
    rows = len(logits)
    top_k = None if ks is None else torch.tensor(ks * (rows // len(ks)))
    top_p = None if ps is None else torch.tensor(ps * (rows // len(ps)))
    _same_kept(top_k_top_p(logits, top_k, top_p), top_k_top_p_sorted(logits, top_k, top_p))


def test_ties_with_the_kth_past_the_candidates_are_kept():
    logits = _rows(1.0, rows=2)
    logits[:, :100] = 50.0  # a hundred equal maxima: top_k 3 keeps them all
    top_k = torch.tensor([3, 3])
    out = top_k_top_p(logits, top_k, None)
    assert out.isfinite().sum(dim=-1).tolist() == [100, 100]
    _same_kept(out, top_k_top_p_sorted(logits, top_k, None))


@pytest.mark.parametrize("nucleus_kernel", [True, False])
def test_settled_rows_never_sort_the_vocabulary(monkeypatch, nucleus_kernel):
    """top_p alone goes to the nucleus kernel; without it (no compiler) a peaked row is settled
    on the candidates, and so is a top_k inside them: the sort never runs."""

    def refuse(*args):
        raise AssertionError("sorted a settled row")

    monkeypatch.setattr(filters, "top_k_top_p_ref", refuse)
    if not nucleus_kernel:
        monkeypatch.setattr(filters.cpu_sampling, "top_p", lambda *args: None)
    logits = _rows(4.0)
    rows = len(logits)
    out = top_k_top_p(logits, None, torch.full((rows,), 0.9))
    assert (out.isfinite().sum(dim=-1) <= CANDIDATES).all()
    top_k = torch.tensor([5, VOCAB] * (rows // 2))
    out = top_k_top_p(logits, top_k, torch.full((rows,), 0.9))
    assert (out.isfinite().sum(dim=-1) <= CANDIDATES).all()


@pytest.mark.parametrize("scale", [4.0, 0.1])
def test_without_the_nucleus_kernel_the_kept_tokens_are_the_same(monkeypatch, scale):
    monkeypatch.setattr(filters.cpu_sampling, "top_p", lambda *args: None)
    logits = _rows(scale)
    top_p = torch.tensor([0.9, 0.5, 0.99, 1.0] * 3)
    _same_kept(top_k_top_p(logits, None, top_p), top_k_top_p_sorted(logits, None, top_p))


def test_the_input_is_left_as_it_was():
    logits = _rows(0.1)
    before = logits.clone()
    top_k_top_p(logits, torch.full((len(logits),), 5), torch.full((len(logits),), 0.5))
    assert torch.equal(logits, before)
