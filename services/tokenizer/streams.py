"""One client stream: the scheduler's SampleDeltas in, numbered GenerateEvents out.

No NATS here. Each sample has an IncrementalDetokenizer (multi-byte characters, stop strings
with held-back partial matches). A stop string ends a sample at once on the text side; the
stream asks the scheduler to finish it (`FinishRequest`) and ends the sample when the
scheduler answers, so the final event always follows the freeing of the request's blocks.
"""

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer
from schemas.public import ErrorInfo, GenerateEvent, TokenLogprob, Usage
from schemas.scheduler import FinishRequest
from schemas.tokenizer import SampleDelta
from services.tokenizer.requests import Prepared


@dataclass
class _Sample:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    stop_string: str | None = None  # matched; the scheduler is finishing the sample
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with stream: false, everything is kept for the one final event
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_score: float | None = None  # beam search


class Stream:
    def __init__(
        self, prepared: Prepared, tokenizer: PreTrainedTokenizerBase, reply_to: str, msgpack: bool
    ) -> None:
        self.request_id = prepared.request_id
        self.reply_to = reply_to
        self.msgpack = msgpack
        self.streaming = prepared.stream
        self.num_prompt_tokens = len(prepared.prompt_token_ids)
        self.num_cached_tokens = 0
        self.error: ErrorInfo | None = None  # on the final event: why the request failed
        self.abort_error: ErrorInfo | None = None  # why we aborted it (deadline, shutdown)
        self.submitted = False  # the scheduler accepted it
        self.scheduler_id = ""  # the scheduler that accepted it
        self.aborting = False
        self.last_sent_at = time.monotonic()  # an event or keepalive went to the client
        self._seq = 0
        self._samples = [
            _Sample(IncrementalDetokenizer(tokenizer, prepared.prompt_token_ids, prepared.params))
            for _ in range(prepared.params.n)
        ]

    @property
    def done(self) -> bool:
        return all(sample.finish_reason is not None for sample in self._samples)

    def on_delta(self, delta: SampleDelta) -> tuple[list[GenerateEvent], FinishRequest | None]:
        """Events to publish, and a FinishRequest for the scheduler if a stop string matched."""
        sample = self._samples[delta.index]
        if sample.finish_reason is not None:
            return [], None
        text, token_ids, logprobs = "", [], None
        if sample.stop_string is None:  # tokens after a stop string are not output
            text, token_ids = sample.detokenizer.add_tokens(delta.token_ids), delta.token_ids
            logprobs = _public_logprobs(delta)
            sample.num_tokens += len(token_ids)
            sample.stop_string = sample.detokenizer.stopped
        finish = None
        if delta.finish_reason is not None:
            text += self._finish_sample(sample, delta)
        elif sample.stop_string is not None and token_ids:
            finish = FinishRequest(self.request_id, "stop", delta.index, sample.stop_string)
        event = self._event(delta.index, sample, text, token_ids, logprobs)
        return ([event] if event is not None else []), finish

    def _finish_sample(self, sample: _Sample, delta: SampleDelta) -> str:
        sample.finish_reason = "stop" if sample.stop_string else delta.finish_reason
        sample.stop_reason = sample.stop_string or delta.stop_reason
        sample.cumulative_score = delta.cumulative_score
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.error is not None:
            self.error = delta.error
        elif delta.finish_reason == "abort":
            self.error = self.abort_error
        return sample.detokenizer.flush()  # "" after a stop string

    def _event(self, index, sample, text, token_ids, logprobs) -> GenerateEvent | None:
        if not self.streaming:
            sample.texts.append(text)
            sample.token_ids += token_ids
            if logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + logprobs
            if sample.finish_reason is None:
                return None
            text, token_ids, logprobs = "".join(sample.texts), sample.token_ids, sample.logprobs
        elif not text and not token_ids and sample.finish_reason is None:
            return None
        return self._next_event(
            index=index,
            text=text,
            token_ids=list(token_ids),
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            cumulative_score=sample.cumulative_score,
        )

    def _next_event(self, **fields) -> GenerateEvent:
        final = self.done
        if fields["finish_reason"] is not None and self.error is not None:
            fields["error"] = self.error
        event = GenerateEvent(
            request_id=self.request_id,
            seq=self._seq,
            usage=self.usage() if final else None,
            **fields,
        )
        self._seq += 1
        return event

    def end(self, error: ErrorInfo, finish_reason: str = "error") -> list[GenerateEvent]:
        """End every open sample now (the scheduler is gone or refused the request)."""
        self.error = error
        events = []
        for index, sample in enumerate(self._samples):
            if sample.finish_reason is None:
                sample.finish_reason = finish_reason
                events.append(self._next_event(index=index, finish_reason=finish_reason))
        return events

    def usage(self) -> Usage:
        return Usage(
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=sum(sample.num_tokens for sample in self._samples),
            num_cached_prompt_tokens=self.num_cached_tokens,
        )


def error_event(request_id: str, error: ErrorInfo, num_prompt_tokens: int = 0) -> GenerateEvent:
    """The one event of a request refused before it had a stream."""
    return GenerateEvent(
        request_id=request_id,
        seq=0,
        finish_reason="error",
        error=error,
        usage=Usage(
            num_prompt_tokens=num_prompt_tokens, num_completion_tokens=0, num_cached_prompt_tokens=0
        ),
    )


def _public_logprobs(delta: SampleDelta) -> list[TokenLogprob] | None:
    if delta.logprobs is None:
        return None
    return [
        TokenLogprob(token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs)
        for token_id, lp in zip(delta.token_ids, delta.logprobs)
    ]
