"""What the offline API returns, shaped like vLLM's RequestOutput: code written for vLLM reads
`outputs[i].logprobs` and `prompt_logprobs` unchanged (lists of {token id: Logprob})."""

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import PromptLogprobs, TokenLogprobs

Decode = Callable[[int], str]


@dataclass
class Logprob:
    """vLLM's (vllm.logprobs.Logprob): a token's logprob, its rank (1: the most likely; None
    for a sampled token outside the top alternatives asked for, whose rank the engine does not
    compute) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first token, then per token {token id: Logprob}, the
# prompt's own token first, then the top alternatives not already there
PromptLogprobList = list[dict[int, Logprob] | None]
# vLLM's sample logprobs: per generated token {token id: Logprob}, the sampled token first,
# then the `logprobs` top alternatives not already there, best first
SampleLogprobList = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobList | None = None
    cumulative_score: float | None = None  # beam search: length-penalised log-prob
    error: ErrorInfo | None = None  # why it ended, when finish_reason is "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobList | None = None  # when SamplingParams.prompt_logprobs
    # `cache`: prompt tokens newly pinned; num_cached_tokens by tier (device, cpu, disk)
    num_cache_write_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


def sample_logprob_list(
    token_ids: list[int], logprobs: list[TokenLogprobs], decode: Decode
) -> SampleLogprobList:
    """The engine's per-token TokenLogprobs in vLLM's shape."""
    out: SampleLogprobList = []
    for token_id, token in zip(token_ids, logprobs, strict=True):
        ranked = dict(zip(token.top_token_ids, range(1, len(token.top_token_ids) + 1)))
        entry = {token_id: Logprob(token.logprob, ranked.get(token_id), decode(token_id))}
        for rank, (top_id, top_lp) in enumerate(zip(token.top_token_ids, token.top_logprobs), 1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_lp, rank, decode(top_id))
        out.append(entry)
    return out


def prompt_logprob_list(
    prompt_token_ids: list[int], whole: PromptLogprobs, decode: Decode
) -> PromptLogprobList:
    """The engine's whole-prompt PromptLogprobs in vLLM's shape."""
    out: PromptLogprobList = [None]
    for i, token_id in enumerate(prompt_token_ids[1:]):
        entry = {token_id: Logprob(whole.logprobs[i], whole.ranks[i], decode(token_id))}
        for rank, (top_id, top_lp) in enumerate(
            zip(whole.top_token_ids[i], whole.top_logprobs[i]), start=1
        ):
            if top_id not in entry:
                entry[top_id] = Logprob(top_lp, rank, decode(top_id))
        out.append(entry)
    return out
