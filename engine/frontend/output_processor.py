"""The output path shared by both front doors: one sample's SampleDeltas in, its text out.

Each sample has an IncrementalDetokenizer (multi-byte characters, stop strings with held-back
partial matches). A stop string ends the sample's text at once; the caller then asks the
engine core to finish the sample (`EngineCore.finish_early`, in-process or as a
FinishRequest over NATS), and the sample ends when its final delta comes back, so the end
of a stream always follows the freeing of its blocks. The offline `LLM` builds
CompletionOutputs from the updates, the tokenizer service GenerateEvents.
"""

from dataclasses import dataclass

from kvpager.engine.frontend.detokenizer import IncrementalDetokenizer
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import TokenLogprobs
from kvpager.schemas.tokenizer import SampleDelta
from transformers import PreTrainedTokenizerBase


@dataclass
class SampleUpdate:
    """What one delta added to a sample."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    # a stop string matched in this delta's text: the engine must finish the sample
    stop_matched: bool = False


class SampleOutput:
    """One sample's output as its deltas arrive."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.num_tokens = 0  # output tokens shown (those after a stop string are not)
        self.stop_string: str | None = None  # matched; the engine is finishing the sample
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.num_cache_write_tokens = 0  # prompt tokens the request newly pinned
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.error: ErrorInfo | None = None
        self.cumulative_score: float | None = None  # beam search

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: SampleDelta) -> SampleUpdate | None:
        """The delta's text and tokens; None once the sample has finished."""
        if self.finished:
            return None
        update = SampleUpdate("", [], None)
        if self.stop_string is None:  # tokens after a stop string are not output
            num_shown = self._add_text(update, delta.token_ids)
            update.token_ids = delta.token_ids[:num_shown]
            update.logprobs = None if delta.logprobs is None else delta.logprobs[:num_shown]
            self.num_tokens += num_shown
            self.stop_string = self.detokenizer.stopped
            update.stop_matched = self.stop_string is not None and bool(delta.token_ids)
        if delta.finish_reason is not None:
            update.text += self._finish(delta)
            update.stop_matched = False
        return update

    def _add_text(self, update: SampleUpdate, token_ids: list[int]) -> int:
        """Detokenize a delta's tokens one by one (a delta holds several when proposals were
        accepted), so a stop string ends the output at its token; returns the tokens shown."""
        for num_shown, token_id in enumerate(token_ids, start=1):
            update.text += self.detokenizer.add_tokens([token_id])
            if self.detokenizer.stopped is not None:
                return num_shown
        return len(token_ids)

    def _finish(self, delta: SampleDelta) -> str:
        self.finish_reason = "stop" if self.stop_string else delta.finish_reason
        self.stop_reason = self.stop_string or delta.stop_reason
        self.cumulative_score = delta.cumulative_score
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_cache_write_tokens = delta.num_cache_write_tokens
        self.cached_tokens_by_tier = delta.cached_tokens_by_tier
        self.error = delta.error
        return self.detokenizer.flush()  # "" after a stop string
