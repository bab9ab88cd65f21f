"""The scheduler's side of prompt logprobs: the executor's chunks, checked and put together.

Each prefill chunk's StepOutput carries the prompt positions it computed. They come over the
wire, so every chunk is checked against the request before it is kept (positions inside the
prompt and in order, lists of one length, `k` alternatives, ids in the vocabulary). A chunk
that starts before the collected end replaces from there (the request was recomputed after a
preemption). The whole prompt's goes out once, with the request's first token delta.
"""

import numpy as np
from kvpager.engine.request import Request
from kvpager.schemas.errors import InvalidStepError
from kvpager.schemas.scheduler import PromptLogprobs


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidStepError(f"prompt logprobs: {message}")


def check_chunk(chunk: PromptLogprobs, request: Request, vocab_size: int) -> None:
    """Raise InvalidStepError unless `chunk` fits the request and the vocabulary (0: ids are
    not checked)."""
    k = request.sampling_params.prompt_logprobs
    _require(k is not None, f"{request.seq_id!r} did not ask for them")
    num = len(chunk.logprobs)
    end = chunk.start + num
    inside = 1 <= chunk.start and end <= request.num_prompt_tokens
    _require(inside, f"positions {chunk.start}+{num}")
    lengths = {len(chunk.ranks), len(chunk.top_token_ids), len(chunk.top_logprobs)}
    _require(lengths == {num}, "lists of different lengths")
    _require(all(len(ids) == k for ids in chunk.top_token_ids), f"not {k} alternatives")
    _require(all(len(lps) == k for lps in chunk.top_logprobs), f"not {k} alternatives")
    values = np.asarray(chunk.logprobs + [lp for lps in chunk.top_logprobs for lp in lps])
    _require(not (np.isnan(values).any() or (values > 0.0).any()), "not log-probabilities")
    if vocab_size and num:
        ranks = np.asarray(chunk.ranks, dtype=np.int64)
        _require(1 <= int(ranks.min()) and int(ranks.max()) <= vocab_size, "ranks")
    ids = [t for row in chunk.top_token_ids for t in row]
    if vocab_size and ids:
        array = np.asarray(ids, dtype=np.int64)
        _require(0 <= int(array.min()) and int(array.max()) < vocab_size, "token ids")


class PromptLogprobsCollector:
    """Chunks collected per request id until the request's first token."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._collected: dict[str, PromptLogprobs] = {}

    def add(self, request: Request, chunk: PromptLogprobs) -> None:
        check_chunk(chunk, request, self.vocab_size)
        whole = self._collected.setdefault(request.request_id, _empty())
        keep = chunk.start - 1  # positions 1 .. start-1 stay
        _require(keep <= len(whole.logprobs), f"a gap before position {chunk.start}")
        for name in ("logprobs", "ranks", "top_token_ids", "top_logprobs"):
            kept = getattr(whole, name)[:keep]
            setattr(whole, name, kept + getattr(chunk, name))

    def take(self, request: Request) -> PromptLogprobs | None:
        """The whole prompt's, for a request that asked (once; None after that, or if it did
        not ask). Raises InvalidStepError if the executor left positions out."""
        if request.sampling_params.prompt_logprobs is None:
            return None
        whole = self._collected.pop(request.request_id, None)
        if whole is None:
            if request.num_output_tokens > 1 or request.sample_index:
                return None  # delivered already
            whole = _empty()  # a one-token prompt has no prompt logprobs
        _require(len(whole.logprobs) == request.num_prompt_tokens - 1, "positions missing")
        return whole

    def forget(self, request_id: str) -> None:
        self._collected.pop(request_id, None)


def _empty() -> PromptLogprobs:
    return PromptLogprobs(start=1, logprobs=[], ranks=[], top_token_ids=[], top_logprobs=[])
