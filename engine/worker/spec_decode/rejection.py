"""Speculative sampling with a proposer that has a distribution: Leviathan et al.'s rule.

A draft model samples its proposal x_{j+1} from its own distribution q_{j+1}; the target's
p_j (after the sampler's penalties, temperature and filters, verify.py's rows) decides:

    accept x with probability min(1, p_j(x) / q_{j+1}(x)); on the first rejection emit a token
    drawn from the residual norm(max(0, p_j - q_{j+1})) and stop; with every proposal
    accepted, emit the bonus token, the sampler's own draw from p_d.

Every emitted token then has the target's distribution, whatever q is, and a good q is
accepted with probability sum(min(p, q)), where verify.py's rule (accept while the target's
own draw equals the proposal) gets only sum(p * q). The rule applies to random rows without a
seed or logprobs (`samples_drafts`): a seeded row keeps verify.py's rule, so its tokens stay a
function of (seed, position) alone and equal those without speculation; a row with logprobs
keeps it so that each emitted token's logprobs are its row's. verify.py's rule is correct for
any proposer, so it is also the fallback where the proposals verified are not the ones whose
q was kept (the scheduler cut or dropped them).
"""

import torch
from kvpager.engine.worker.input_batch import RequestState
from kvpager.engine.worker.spec_decode.verify import VerifyRows
from kvpager.schemas.sampling import SamplingParams

_MIN_TEMPERATURE = 1e-5  # the sampler's greedy threshold


def samples_drafts(params: SamplingParams) -> bool:
    """Rows whose draft proposals are sampled from q and verified by this rule."""
    random = params.temperature >= _MIN_TEMPERATURE
    return random and params.seed is None and params.logprobs is None


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: list[int],
    bonus: int,
    generator: torch.Generator | None,
) -> list[int]:
    """p float32 [d + 1, vocab] (the target's rows), q float32 [d, vocab] (the draft's rows
    its proposals were drawn from), `bonus` a draw from p[d]: the tokens emitted."""
    d = len(drafts)
    u = torch.rand(d, generator=generator, device=p.device, dtype=torch.float64).tolist()
    p_x = p[torch.arange(d), drafts].tolist()
    q_x = q[torch.arange(d), drafts].tolist()
    for j in range(d):
        if u[j] * q_x[j] < p_x[j]:  # probability min(1, p / q); q(x) > 0 as x was drawn
            continue
        residual = (p[j] - q[j]).clamp_min_(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: p itself is the residual
            residual = p[j]
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [bonus]


def accept_sampled_drafts(
    states: list[RequestState],
    rows: VerifyRows,
    sampled: list[int],
    probs: torch.Tensor,
    emitted: list[list[int]],
    generator: torch.Generator | None,
) -> list[list[int]]:
    """`emitted` (verify.py's rule) with this rule's tokens where a row's q was kept; each
    kept q is used once."""
    emitted = list(emitted)
    for i, (state, offset) in enumerate(zip(states, rows.offsets, strict=True)):
        drafts, kept = state.draft_token_ids, state.draft_probs
        state.draft_probs = None
        if not drafts or kept is None or kept[0][: len(drafts)] != drafts:
            continue
        d = len(drafts)
        p, q = probs[offset : offset + d + 1], kept[1][:d].to(probs.device)
        emitted[i] = rejection_sample(p, q, drafts, sampled[offset + d], generator)
    return emitted
