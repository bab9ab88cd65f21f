"""Top-k and top-p (nucleus) filtering of sampling logits, without sorting the vocabulary where
a row's kept tokens are among its largest few.

Both filters are defined on each row sorted by logit, and torch's CPU sort of a 64 x 49,152
step took 98 ms on 2 threads, where the rest of a temperature-1 sampler takes ~6: a batch
whose requests send top_p (many clients do) ran at about half speed. The tokens a nucleus
keeps are nearly always among a row's largest few dozen, so the candidates come from `topk`
(CANDIDATES of them: 2.9 ms), and only a row they cannot settle (a flat distribution, a top_k
past them, ties with its k-th running past them) goes on: a top_p alone to the C nucleus
kernel (kernels/cpu_sampling.py: a histogram of the row's mass, only the boundary's bucket
sorted), anything else sorted whole. The kept sets are the sorted filter's
(kernels/reference.py top_k_top_p_ref), row for row.
"""

import torch

from kernels import cpu_sampling
from kernels.reference import top_k_top_p_ref

CANDIDATES = 64


def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the top_k largest logits (ties with the k-th kept too), then the smallest prefix of
    the rest, by probability, whose mass reaches top_p; the others become -inf (a new tensor).
    top_k int64 [rows] (the vocab size: none), top_p float [rows] (1.0: none), or None."""
    rows, vocab = logits.shape
    width = min(CANDIDATES, vocab)
    values, ids = logits.topk(width, dim=-1)  # each row's largest, in descending order
    none = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    has_k = none if top_k is None else top_k < vocab
    has_p = none if top_p is None else top_p < 1.0
    kept, settled = values.clone(), none
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        kept.masked_fill_(values < kth, float("-inf"))
        # the k-th and every tie of it are candidates: the last candidate is below it
        past_ties = (values[:, -1] < kth[:, 0]) | (width == vocab)
        settled = has_k & (top_k <= width) & past_ties
    if top_p is not None:
        # the row's normaliser: its top_k set's (all candidates) or the whole row's
        norm = torch.where(
            settled.unsqueeze(1),
            kept.logsumexp(dim=-1, keepdim=True),
            logits.logsumexp(dim=-1, keepdim=True),
        )
        probs = (kept - norm).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        kept.masked_fill_((mass_before >= top_p.unsqueeze(1)) & has_p.unsqueeze(1), float("-inf"))
        # without a top_k, what lies past the candidates is dropped once they reach top_p
        reaches = (probs.sum(dim=-1) >= top_p) | (width == vocab)
        settled = settled | (~has_k & has_p & reaches)
    out = torch.full_like(logits, float("-inf")).scatter_(1, ids, kept)
    untouched = ~has_k & ~has_p
    out[untouched] = logits[untouched]
    unsettled = torch.nonzero(~settled & ~untouched).flatten()
    if unsettled.numel():
        out[unsettled] = _unsettled_rows(logits[unsettled], *_rows_of(unsettled, top_k, top_p))
    return out


def _rows_of(rows: torch.Tensor, *values: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if v is None else v[rows] for v in values]


def _unsettled_rows(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Rows the candidates did not settle: top_p alone on the C nucleus kernel (no sort), the
    rest (a top_k past the candidates, ties, no kernel) sorted whole."""
    vocab = logits.shape[1]
    if top_p is not None and (top_k is None or bool((top_k >= vocab).all())):
        out = cpu_sampling.top_p(logits, top_p)
        if out is not None:
            return out
    return top_k_top_p_ref(logits, top_k, top_p)
