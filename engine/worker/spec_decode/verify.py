"""Verifying proposed tokens: one sampling row per position, accepted while they agree.

A sequence with d proposals x_1..x_d computes 1 + d positions in one forward; position j's
logits give the distribution p_j of the token after x_1..x_j. Every position is sampled as
the sampler samples an ordinary step, through the same penalties, bans and filters, with
the outputs so far plus x_1..x_j as its history and the seed position of the token it would
be: y_j = sample(p_j; seed, output position). Then

    accept x_{j+1} while y_j == x_{j+1}; emit the accepted ones and the first y_j that differs
    (or y_d, the bonus token, when all were accepted).

For greedy rows this is "accept while the argmax equals the proposal". For random rows it is
the standard accept/reject of speculative sampling with a deterministic proposer (q one-hot
at x): P(accept x) = P(y = x) = p(x), and a rejection emits y ~ p given y != x, which is the
residual norm(max(p - q, 0)) = p with x removed and renormalised. The residual is drawn
implicitly, by the same inverse-CDF draw (engine/worker/sampling/sampler.py) that drew y, so a
seeded row's tokens are a function of (seed, output position) and its prefix alone: the same
tokens with or without speculation, whatever k, batch or instance (migrated streams stay
reproducible). Unseeded rows draw each position independently from the engine's generator;
rows after the first rejection are discarded, so every emitted token has exactly p.
"""

from dataclasses import dataclass

import torch
from kvpager.engine.worker.input_batch import InputBatch, RequestState
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput, TokenLogprobs


@dataclass
class VerifyRows:
    """The sampling rows of one step: state i owns rows offsets[i] .. offsets[i] + d_i."""

    logits_rows: list[int]  # into cat([logits of each state's last position, draft logits])
    params: list[SamplingParams]
    seed_positions: list[int]
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    offsets: list[int]

    @classmethod
    def build(
        cls, states: list[RequestState], batch: InputBatch, with_prompts: bool
    ) -> "VerifyRows":
        rows = cls([], [], [], [], [], [])
        num_states, num_drafts_before = len(states), 0
        for idx, state in enumerate(states):
            drafts = state.draft_token_ids
            rows.offsets.append(len(rows.params))
            draft_rows = range(
                num_states + num_drafts_before, num_states + num_drafts_before + len(drafts)
            )
            rows.logits_rows += [*draft_rows, idx]
            num_drafts_before += len(drafts)
            prompt = batch.prompt_token_ids(state) if with_prompts else []
            position = batch.seed_position(state)
            for j in range(len(drafts) + 1):
                rows.params.append(state.params)
                rows.seed_positions.append(position + j)
                rows.output_token_ids.append(state.output_token_ids + drafts[:j])
                rows.prompt_token_ids.append(prompt)
        return rows

    def gather(self, logits: torch.Tensor, draft_logits: torch.Tensor | None) -> torch.Tensor:
        """[num_rows, vocab]: each row's logits, in row order."""
        if draft_logits is None:
            return logits  # one row a state, in state order already
        both = torch.cat([logits, draft_logits])
        index = torch.tensor(self.logits_rows, dtype=torch.int64, device=logits.device)
        return both[index]


def accept(states: list[RequestState], rows: VerifyRows, sampled: list[int]) -> list[list[int]]:
    """Per state, the tokens it emits: accepted proposals, then the model's own token."""
    emitted = []
    for state, offset in zip(states, rows.offsets, strict=True):
        tokens = []
        for j, proposal in enumerate(state.draft_token_ids):
            tokens.append(sampled[offset + j])
            if sampled[offset + j] != proposal:
                break
        else:
            tokens.append(sampled[offset + len(state.draft_token_ids)])
        emitted.append(tokens)
    return emitted


def step_output(
    step_id: int,
    states: list[RequestState],
    rows: VerifyRows,
    emitted: list[list[int]],
    row_logprobs: list[TokenLogprobs] | None,
) -> StepOutput:
    """The tokens each state emitted (the first in `sampled_token_ids`, the rest in
    `extra_token_ids`), with the logprobs of their rows when any were asked for."""
    output = StepOutput(
        step_id=step_id,
        seq_ids=[s.seq_id for s in states],
        sampled_token_ids=[tokens[0] for tokens in emitted],
    )
    several = [(s, offset, tokens) for s, offset, tokens in zip(states, rows.offsets, emitted)]
    several = [entry for entry in several if len(entry[2]) > 1]
    output.extra_token_ids = {s.seq_id: tokens[1:] for s, _, tokens in several}
    if row_logprobs is not None:
        output.logprobs = [row_logprobs[offset] for offset in rows.offsets]
        output.extra_logprobs = {
            s.seq_id: row_logprobs[offset + 1 : offset + len(tokens)]
            for s, offset, tokens in several
        }
    return output
