"""One client stream: the scheduler's SampleDeltas in, numbered GenerateEvents out.

No NATS here. Each sample's text comes from the engine's output processor (detokenizing, stop
strings); a stop string makes the stream ask the scheduler to finish the sample
(`FinishRequest`), and the sample ends when the scheduler answers, so the final event always
follows the freeing of the request's blocks.
"""

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass, field

import msgspec
from kvpager.engine.frontend.migration import can_move, continuation
from kvpager.engine.frontend.output_processor import SampleOutput, SampleUpdate
from kvpager.schemas.kv_transfer import KvHandoff
from kvpager.schemas.public import ErrorInfo, GenerateEvent, PromptLogprob, TokenLogprob, Usage
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import FinishRequest, PromptLogprobs
from kvpager.schemas.tokenizer import SampleDelta
from kvpager.services.tokenizer.requests import Prepared
from kvpager.services.wire import DEFAULT_MAX_PAYLOAD, PAYLOAD_HEADROOM
from transformers import PreTrainedTokenizerBase


@dataclass
class _Sample:
    output: SampleOutput
    finish_reason: str | None = None  # as the client sees it (set when the stream ends it too)
    # with stream: false, everything is kept for the one final event
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class Stream:
    def __init__(
        self,
        prepared: Prepared,
        tokenizer: PreTrainedTokenizerBase,
        reply_to: str,
        msgpack: bool,
        max_event_bytes: int = DEFAULT_MAX_PAYLOAD - PAYLOAD_HEADROOM,
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
        self.answered = asyncio.Event()  # set with `submitted`: the add's answer came
        self.scheduler_id = ""  # the scheduler that accepted it
        self.instance = ""  # the instance it runs on
        # what migration needs: the request as prepared, and sample 0's tokens so far
        self.prompt_token_ids = prepared.prompt_token_ids
        self.params = prepared.params
        self.model = prepared.model
        self.cache_salt = prepared.cache_salt
        self.priority = prepared.priority
        self.pin_tokens, self.pin_ttl = prepared.pin_tokens, prepared.pin_ttl  # `cache`
        self.num_cache_write_tokens = 0
        self.cached_tokens_by_tier: dict[str, int] = {}
        self.generated: list[int] = []
        self.num_migrations = 0
        self.num_handoffs = 0  # prefill -> decode (disaggregation): its prompt holds outputs too
        self.kv_held: KvHandoff | None = None  # the blocks the prefill instance holds for it
        self.failed_instances: set[str] = set()
        self.aborting = False
        # what an llm.abort must carry; one made here goes to the client in the first event
        self.abort_token = prepared.abort_token or secrets.token_urlsafe(16)
        self._announce_token = prepared.abort_token is None
        self.last_sent_at = time.monotonic()  # an event or keepalive went to the client
        self._seq = 0
        # fields for the next event: the echoed prompt (first event), the prompt's logprobs
        self._texts = TokenTexts(tokenizer)
        self._pending: dict = self._echoed_prompt(prepared)
        self._samples = [
            _Sample(SampleOutput(tokenizer, prepared.prompt_token_ids, prepared.params))
            for _ in range(prepared.params.n)
        ]
        self._prompt_logprob_rows = prompt_logprob_rows(prepared.params, max_event_bytes)

    def _echoed_prompt(self, prepared: Prepared) -> dict:
        """The first event's echo of the prompt, when the request asked for it."""
        if prepared.prompt_text is None:
            return {}
        return {
            "prompt_token_ids": prepared.prompt_token_ids,
            "prompt_text": prepared.prompt_text,
            "prompt_tokens": self._texts.of(prepared.prompt_token_ids),
        }

    def may_abort(self, abort_token: str | None) -> bool:
        """An abort comes from the stream's owner: it carries the stream's token."""
        return abort_token is not None and hmac.compare_digest(
            abort_token.encode(), self.abort_token.encode()
        )

    @property
    def done(self) -> bool:
        return all(sample.finish_reason is not None for sample in self._samples)

    @property
    def stopping(self) -> bool:
        """A stop string matched: the scheduler is finishing the stream, which goes nowhere."""
        return any(sample.output.stop_string is not None for sample in self._samples)

    def on_delta(self, delta: SampleDelta) -> tuple[list[GenerateEvent], FinishRequest | None]:
        """Events to publish, and a FinishRequest for the scheduler if a stop string matched."""
        sample = self._samples[delta.index]
        self.generated += delta.token_ids  # (one sample, when it can move)
        if delta.prompt_logprobs is not None:  # it may come in several deltas: they follow on
            logprobs = public_prompt_logprobs(
                self.prompt_token_ids, delta.prompt_logprobs, self._texts
            )
            self._pending["prompt_logprobs"] = self._pending.get("prompt_logprobs", []) + logprobs
        update = None if sample.finish_reason is not None else sample.output.add(delta)
        if update is None:
            return [], None
        finish = None
        if sample.output.finished:
            self._finish_sample(sample)
        elif update.stop_matched:
            stop = sample.output.stop_string
            finish = FinishRequest(self.request_id, "stop", delta.index, stop)
        return self._event(delta.index, sample, update), finish

    def _finish_sample(self, sample: _Sample) -> None:
        output = sample.output
        sample.finish_reason = output.finish_reason
        cached = output.num_cached_tokens
        if self.num_migrations or self.num_handoffs:  # its prompt held outputs: not the client's
            cached = min(cached, self.num_prompt_tokens)
        if cached >= self.num_cached_tokens:
            self.cached_tokens_by_tier = dict(output.cached_tokens_by_tier)
        self.num_cached_tokens = max(self.num_cached_tokens, cached)
        writes = output.num_cache_write_tokens
        self.num_cache_write_tokens = max(self.num_cache_write_tokens, writes)
        if output.error is not None:
            self.error = output.error
        elif output.finish_reason == "abort":
            self.error = self.abort_error

    def _event(self, index: int, sample: _Sample, update: SampleUpdate) -> list[GenerateEvent]:
        text, token_ids = update.text, update.token_ids
        logprobs = _public_logprobs(token_ids, update.logprobs, self._texts)
        if not self.streaming:
            sample.texts.append(text)
            sample.token_ids += token_ids
            if logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + logprobs
            if sample.finish_reason is None:
                return []
            text, token_ids, logprobs = "".join(sample.texts), sample.token_ids, sample.logprobs
        elif not text and not token_ids and sample.finish_reason is None:
            return []
        return self._next_events(
            index=index,
            text=text,
            token_ids=list(token_ids),
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.output.stop_reason,
            cumulative_score=sample.output.cumulative_score,
        )

    def _next_events(self, **fields) -> list[GenerateEvent]:
        """The next event, after events with the leading prompt logprobs alone when they are
        too many for one message (the client joins them: they follow on)."""
        events = []
        rows = self._pending.get("prompt_logprobs") or []
        while len(rows) > self._prompt_logprob_rows:
            head, rows = rows[: self._prompt_logprob_rows], rows[self._prompt_logprob_rows :]
            self._pending["prompt_logprobs"] = head
            events.append(self._next_event(final=False, index=fields["index"]))
            self._pending["prompt_logprobs"] = rows
        return [*events, self._next_event(**fields)]

    def _next_event(self, final: bool | None = None, **fields) -> GenerateEvent:
        """`final`: a sample's last event, which carries the usage so far (schemas/public.py);
        by default, the events that finish their sample."""
        final = fields.get("finish_reason") is not None if final is None else final
        if fields.get("finish_reason") is not None and self.error is not None:
            fields["error"] = self.error
        if self._seq == 0 and self._announce_token:
            fields["abort_token"] = self.abort_token
        fields.update(self._pending)
        self._pending = {}
        event = GenerateEvent(
            request_id=self.request_id,
            seq=self._seq,
            usage=self.usage() if final else None,
            num_prompt_tokens=None if self._seq else self.num_prompt_tokens,
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
                events += self._next_events(index=index, finish_reason=finish_reason)
        return events

    def continuation(self) -> tuple[list[int], SamplingParams] | None:
        """The request that goes on from the tokens so far, or None if it cannot move."""
        if not can_move(self.params):
            return None
        return continuation(self.prompt_token_ids, self.generated, self.params)

    def moving_from(self, instance: str) -> None:
        """Its instance failed: deltas from there are late from now on."""
        self.failed_instances.add(instance)
        self.num_migrations += 1
        self._leave()

    def handed_on(self, handoff: KvHandoff) -> None:
        """A prefill instance handed it on: it goes on elsewhere (no failure)."""
        self.num_handoffs += 1
        self.kv_held = handoff
        self._leave()

    def _leave(self) -> None:
        self.instance, self.submitted, self.scheduler_id = "", False, ""
        self.answered = asyncio.Event()  # the next instance's answer

    def usage(self) -> Usage:
        return Usage(
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=sum(sample.output.num_tokens for sample in self._samples),
            num_cached_prompt_tokens=self.num_cached_tokens,
            num_cache_write_tokens=self.num_cache_write_tokens,
            cached_tokens_by_tier=self.cached_tokens_by_tier,
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


def over_the_limit(event: GenerateEvent, num_bytes: int) -> GenerateEvent:
    """What goes instead of an event too large for the wire (a non-streamed answer with many
    tokens' logprobs): its place in the stream, and on a sample's last event a typed error."""
    if event.finish_reason is None and not event.is_final:
        return GenerateEvent(request_id=event.request_id, seq=event.seq, index=event.index)
    message = (
        f"the response ({num_bytes} bytes) is over the server's NATS max_payload: "
        "ask for fewer tokens or logprobs, or stream it"
    )
    error = ErrorInfo("invalid_request", message, "logprobs")
    return GenerateEvent(
        request_id=event.request_id,
        seq=event.seq,
        index=event.index,
        finish_reason="error",
        usage=event.usage,
        error=error,
        num_prompt_tokens=event.num_prompt_tokens,  # on seq 0: a begun stream, not a refusal
    )


class TokenTexts:
    """Each token's text, for the logprobs and the echoed prompt in the events: the gateway
    shows them and holds no tokenizer. Decoded alone, special tokens kept, as vLLM writes
    them; cached, as the same alternatives come back token after token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def of(self, token_ids: list[int]) -> list[str]:
        return [self.text(token_id) for token_id in token_ids]

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def _public_logprobs(
    token_ids: list[int], logprobs, texts: TokenTexts
) -> list[TokenLogprob] | None:
    if logprobs is None:
        return None
    return [
        TokenLogprob(
            token_id,
            lp.logprob,
            lp.top_token_ids,
            lp.top_logprobs,
            texts.text(token_id),
            texts.of(lp.top_token_ids),
        )
        for token_id, lp in zip(token_ids, logprobs)
    ]


# The longest token text a row is sized for (JSON-escaped): tokenizers' pieces are far shorter.
MAX_TOKEN_TEXT_BYTES = 64


def prompt_logprob_rows(params: SamplingParams, max_event_bytes: int) -> int:
    """Prompt logprob rows one event may carry: half its room over a row's largest JSON."""
    k = params.prompt_logprobs or 0
    text = "x" * MAX_TOKEN_TEXT_BYTES
    widest = PromptLogprob(
        2**31, -1.2345678901234567e-300, 2**31, [2**31] * k, [-1e-300] * k, text, [text] * k
    )
    return max(1, max_event_bytes // (2 * len(msgspec.json.encode(widest))))


def public_prompt_logprobs(
    prompt_token_ids: list[int], whole: PromptLogprobs, texts: TokenTexts
) -> list[PromptLogprob | None]:
    """The engine's prompt logprobs as the public list, positions `whole.start` on: None for
    the first token (which has none) when they start the prompt."""
    out: list[PromptLogprob | None] = [None] if whole.start == 1 else []
    start = whole.start
    for i, token_id in enumerate(prompt_token_ids[start : start + len(whole.logprobs)]):
        out.append(
            PromptLogprob(
                token_id,
                whole.logprobs[i],
                whole.ranks[i],
                whole.top_token_ids[i],
                whole.top_logprobs[i],
                texts.text(token_id),
                texts.of(whole.top_token_ids[i]),
            )
        )
    return out
