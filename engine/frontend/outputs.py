"""What the offline API returns, shaped like vLLM's RequestOutput."""

from dataclasses import dataclass, field

from schemas.public import ErrorInfo
from schemas.scheduler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_score: float | None = None  # beam search: length-penalised log-prob
    error: ErrorInfo | None = None  # why it ended, when finish_reason is "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
