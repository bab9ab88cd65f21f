"""Each beam's best next tokens, from its logits row at the executor (the scheduler's beam
search, engine/sched/beam_search.py, ranks them: it needs no tensor)."""

import torch


def top_continuations(logits: torch.Tensor, states, rows: list[int], eos_ids) -> dict:
    """Each beam's best next tokens, from its logits row at the executor: enough for
    transformers' 2 x beam_width continuations. Beam rows are not sampled."""
    if not rows:
        return {}
    logprobs = logits[rows].log_softmax(dim=-1)
    # per beam at most the group's continuations: (2 + stop tokens) x width bounds them
    needed = max(
        (2 + len(eos_ids) + len(states[i].params.stop_token_ids)) * states[i].params.beam_width
        for i in rows
    )
    values, token_ids = logprobs.topk(min(needed, logprobs.shape[-1]), dim=-1)
    return {
        states[i].seq_id: list(zip(ids, vals))
        for i, ids, vals in zip(rows, token_ids.tolist(), values.tolist())
    }
