"""Top-k and top-p (nucleus) filtering of sampling logits, without sorting the vocabulary.

Both filters are defined on each row sorted by logit (kernels/reference.py top_k_top_p_ref),
and torch's CPU sort of a whole step's vocabulary costs many times the rest of a
temperature-1 sampler: a batch whose requests send top_p (many clients do) would run at about
half speed. So a row with top_p alone goes to the C nucleus kernel
(kernels/cpu_sampling.py: the row's mass in a histogram by logit, only the boundary's bucket
sorted). A row with a top_k is settled on `topk`'s CANDIDATES largest when its kept tokens are all
among them (the k-th and its ties, then the nucleus inside them); only what neither settles (a top_k
past the candidates, ties running past them, no C compiler) is sorted whole. The kept sets are the
sorted filter's, row for row.
"""

import torch
from kvpager.kernels import cpu_sampling
from kvpager.kernels.reference import top_k_top_p_ref

CANDIDATES = 64


def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the top_k largest logits (ties with the k-th kept too), then the smallest prefix of
    the rest, by probability, whose mass reaches top_p; the others become -inf (a new tensor).
    top_k int64 [rows] (the vocab size: none), top_p float [rows] (1.0: none), or None."""
    has_k, has_p = _asks(logits, top_k, top_p)
    filtered = []  # (rows, their filtered logits)
    nucleus = has_p & ~has_k
    if nucleus.any():
        kept = _on_rows(_nucleus, nucleus, logits, top_k, top_p)
        if kept is not None:  # else (no compiler) those rows go with the rest
            filtered.append((nucleus, kept))
            has_p = has_p & ~nucleus
    rest = has_k | has_p
    if rest.any():
        filtered.append((rest, _on_rows(_candidates_or_sorted, rest, logits, top_k, top_p)))
    if len(filtered) == 1 and bool(filtered[0][0].all()):
        return filtered[0][1]  # every row on one path: no copies in and out
    out = logits.clone()  # a row with neither keeps every logit
    for rows, values in filtered:
        out[rows] = values
    return out


def _asks(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows have a top_k, and which a top_p (bool [rows] each)."""
    rows, vocab = logits.shape
    none = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    return (
        none if top_k is None else top_k < vocab,
        none if top_p is None else top_p < 1.0,
    )


def _on_rows(filter_, rows, logits, top_k, top_p):
    """`filter_` over the rows `rows` (bool) picks, indexed only when it is not all of them."""
    if bool(rows.all()):
        return filter_(logits, top_k, top_p)
    picked = torch.nonzero(rows).flatten()
    return filter_(logits[picked], *_rows_of(picked, top_k, top_p))


def _nucleus(logits, top_k, top_p) -> torch.Tensor | None:
    return cpu_sampling.top_p(logits, top_p)


def _rows_of(rows: torch.Tensor, *values: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if v is None else v[rows] for v in values]


def _candidates_or_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """The filter for rows that each have a top_k or a top_p: on topk's candidates where they
    settle the row, the rest sorted whole."""
    vocab = logits.shape[1]
    width = min(CANDIDATES, vocab)
    values, ids = logits.topk(width, dim=-1)  # each row's largest, in descending order
    has_k, has_p = _asks(logits, top_k, top_p)
    kept, settled = values.clone(), torch.zeros_like(has_k)
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
    unsettled = torch.nonzero(~settled).flatten()
    if unsettled.numel():
        out[unsettled] = top_k_top_p_ref(logits[unsettled], *_rows_of(unsettled, top_k, top_p))
    return out
