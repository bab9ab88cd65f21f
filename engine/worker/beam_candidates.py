"""Each beam's best next tokens, from its logits row at the executor (the scheduler's beam
search, engine/sched/beam_search.py, ranks them: it needs no tensor)."""

import torch
from kvpager.engine.sched.beam_search import num_candidates


def top_continuations(logits: torch.Tensor, states, rows: list[int], eos_ids) -> dict:
    """Each beam's best next tokens, from its logits row at the executor: enough for
    the scheduler's selection (engine/sched/beam_search.py). Beam rows are not sampled."""
    if not rows:
        return {}
    logprobs = logits[rows].log_softmax(dim=-1)
    needed = max(num_candidates(states[i].params, eos_ids) for i in rows)
    values, token_ids = logprobs.topk(min(needed, logprobs.shape[-1]), dim=-1)
    return {
        states[i].seq_id: list(zip(ids, vals))
        for i, ids, vals in zip(rows, token_ids.tolist(), values.tolist())
    }
