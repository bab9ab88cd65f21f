"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token under the model, computed
from the hidden states a prefill chunk already has, only for the rows that ask.

A chunk computes token positions [start, start + count). The logits at position p score the
token at p + 1, so the chunk covers prompt tokens start + 1 ... up to the prompt's last; the
logits of the prompt's last position sample the first output token and are not a prompt
logprob. Logprobs are the raw model's: log-softmax of the final logits (soft-capped where
the model caps), before penalties and temperature (vLLM's default `logprobs_mode`).

    positions  s   s+1  ...  P-2  P-1       (P: prompt length, s: the chunk's first)
    scores    s+1  s+2  ...  P-1  (sampled)
"""

from dataclasses import dataclass

import numpy as np
import torch
from kvpager.schemas.scheduler import PromptLogprobs

ROWS_PER_PIECE = 256  # logits rows at once: [256, vocab] fp32 stays small for any vocab


@dataclass(frozen=True)
class PromptSpan:
    """One row's prompt positions in this step's flat batch."""

    seq_id: str
    row: int  # in the request table
    hidden_idx: int  # flat index of the first position's hidden state
    start: int  # the first prompt token scored (its position), >= 1
    num: int  # prompt tokens scored
    k: int  # top alternatives asked


def prompt_spans(states, starts, counts, cu_seqlens) -> list[PromptSpan]:
    """The spans of the rows that ask for prompt logprobs and still compute prompt tokens.
    A row that has outputs already (resumed after preemption) delivered its prompt's then."""
    spans = []
    for i, state in enumerate(states):
        k = state.params.prompt_logprobs
        if k is None or state.output_token_ids:
            continue
        start = int(starts[i])
        end = min(start + int(counts[i]), state.num_prompt_tokens - 1)
        if end > start:
            hidden_idx = int(cu_seqlens[i])
            spans.append(PromptSpan(state.seq_id, state.row, hidden_idx, start + 1, end - start, k))
    return spans


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, spans: list[PromptSpan], token_ids: np.ndarray, report: bool
) -> dict[str, PromptLogprobs]:
    """Each span's PromptLogprobs. Every tensor-parallel rank calls it (the logits are
    gathered across ranks); only the reporting rank (0) reduces them to lists."""
    if not spans:
        return {}
    device = hidden.device
    indices = np.concatenate([np.arange(s.num) + s.hidden_idx for s in spans])
    targets = np.concatenate([token_ids[s.row, s.start : s.start + s.num] for s in spans])
    indices_t = torch.from_numpy(indices).to(device)
    targets_t = torch.from_numpy(targets).to(device)
    max_k = max(s.k for s in spans)
    pieces = []
    for begin in range(0, len(indices), ROWS_PER_PIECE):
        rows = slice(begin, begin + ROWS_PER_PIECE)
        logits = model.compute_logits(hidden[indices_t[rows]])  # fp32 [rows, vocab]
        if report:
            pieces.append(_reduce(logits, targets_t[rows], max_k))
    if not report:
        return {}
    logprobs, ranks, top_ids, top_lps = (torch.cat(parts).tolist() for parts in zip(*pieces))
    return _split(spans, logprobs, ranks, top_ids, top_lps)


def _reduce(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per row: the target's logprob, its rank (vLLM's: how many score at least as high), and
    the top-k ids and logprobs."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top_lps


def _split(spans, logprobs, ranks, top_ids, top_lps) -> dict[str, PromptLogprobs]:
    out, begin = {}, 0
    for span in spans:
        rows = slice(begin, begin + span.num)
        out[span.seq_id] = PromptLogprobs(
            start=span.start,
            logprobs=logprobs[rows],
            ranks=ranks[rows],
            top_token_ids=[ids[: span.k] for ids in top_ids[rows]],
            top_logprobs=[lps[: span.k] for lps in top_lps[rows]],
        )
        begin += span.num
    return out
