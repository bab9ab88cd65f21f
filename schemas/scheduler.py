"""What the scheduler receives from its executor: the tokens sampled by one step."""

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float  # of the sampled token
    top_token_ids: list[int]
    top_logprobs: list[float]


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sampled tokens of the requests whose computed tokens caught up this step."""

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None  # aligned with req_ids when any asked
    # Beam search: per request, the top candidates (token id, log-prob) to extend beams.
    beam_candidates: dict[str, list[tuple[int, float]]] = {}
