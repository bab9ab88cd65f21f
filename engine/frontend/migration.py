"""Migration: a request whose instance died goes on elsewhere as a new request.

The continuation's prompt is the original prompt with the tokens sampled so far appended;
`max_tokens` and `min_tokens` shrink by as many, and `seed_offset` grows by as many, so a
seeded request draws each next token from the same (seed, output position) as it would
have (engine/worker/sampling/sampler.py) and a greedy one computes the very same tokens.
Presence and frequency penalties count output tokens only, which now sit in the prompt:
those requests would change their outputs, so they do not move (nor parallel samples or
beams, whose samples share one prompt).
"""

import msgspec
from kvpager.schemas.sampling import SamplingParams


def can_move(params: SamplingParams) -> bool:
    return (
        params.n == 1
        and not params.is_beam_search
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def continuation(
    prompt_token_ids: list[int], generated: list[int], params: SamplingParams
) -> tuple[list[int], SamplingParams] | None:
    """The request that goes on from `generated`; None when nothing is left to generate."""
    num_generated = len(generated)
    if num_generated >= params.max_tokens:
        return None
    moved = msgspec.structs.replace(
        params,
        max_tokens=params.max_tokens - num_generated,
        min_tokens=max(0, params.min_tokens - num_generated),
        seed_offset=params.seed_offset + num_generated,
        # they came with the first token: a continuation has the outputs in its prompt
        prompt_logprobs=params.prompt_logprobs if not num_generated else None,
    )
    return prompt_token_ids + generated, moved
