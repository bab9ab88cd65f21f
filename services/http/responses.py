"""kvpager's GenerateEvents in OpenAI's shapes: whole responses, stream chunks, usage, logprobs.

A choice is one sample of one prompt: `index = prompt_index * n + sample_index`.
"""

from typing import Any

from schemas.public import GenerateEvent, TokenLogprob, Usage
from services.http import tool_output
from services.http.requests import Job
from services.http.tokens import TokenTexts


def usage(usages: list[Usage]) -> dict[str, Any]:
    prompt = sum(u.num_prompt_tokens for u in usages)
    completion = sum(u.num_completion_tokens for u in usages)
    cached = sum(u.num_cached_prompt_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class RunningUsage:
    """Usage of each choice so far, for vLLM's `continuous_usage_stats` (None without it)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.prompt: dict[int, int] = {}  # by prompt index, from each stream's first event
        self.completion: dict[int, int] = {}  # by choice

    def add(self, prompt_index: int, event: GenerateEvent) -> None:
        if event.num_prompt_tokens is not None:
            self.prompt[prompt_index] = event.num_prompt_tokens
        choice = self.job.choice_index(prompt_index, event.index)
        self.completion[choice] = self.completion.get(choice, 0) + len(event.token_ids)

    def of(self, choice: int) -> dict[str, int] | None:
        if not self.job.continuous_usage:
            return None
        prompt = self.prompt.get(choice // self.job.n, 0)
        completion = self.completion.get(choice, 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


def _head(job: Job, chunk: bool) -> dict[str, Any]:
    if job.kind == "chat":
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": job.response_id, "object": kind, "created": job.created, "model": job.model}


def whole(job: Job, finals: dict[int, GenerateEvent], usages: list[Usage], texts: TokenTexts):
    """The response of `stream: false`: `finals` by choice index, each a sample's one event."""
    choices = [_choice(job, index, finals[index], texts) for index in sorted(finals)]
    return {**_head(job, chunk=False), "choices": choices, "usage": usage(usages)}


def _choice(job: Job, index: int, event: GenerateEvent, texts: TokenTexts) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    finish_reason = event.finish_reason
    if job.tool_mode is not None:
        choice["message"], finish_reason = tool_output.message(
            job.tool_mode, event.text, finish_reason
        )
    elif job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": event.text}
    else:
        choice["text"] = event.text
    choice["logprobs"] = logprobs(job, event, texts)
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = event.stop_reason
    return choice


def delta_chunk(
    job: Job,
    index: int,
    delta: dict[str, Any],
    event: GenerateEvent | None = None,
    running: dict[str, int] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A chat chunk with one delta; with `event`, the choice's last (its finish_reason)."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None}
    choice["finish_reason"] = finish_reason
    if event is not None:
        choice["stop_reason"] = event.stop_reason
    return _chunk(job, [choice], running)


def chunk(
    job: Job,
    index: int,
    event: GenerateEvent,
    texts: TokenTexts,
    text_offset: int = 0,
    running: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One stream event as a chunk of one choice; `text_offset`: the choice's text so far."""
    choice: dict[str, Any] = {"index": index}
    if job.kind == "chat":
        choice["delta"] = {"content": event.text} if event.text else {}
    else:
        choice["text"] = event.text
    choice["logprobs"] = logprobs(job, event, texts, text_offset)
    choice["finish_reason"] = event.finish_reason
    if event.finish_reason is not None:
        choice["stop_reason"] = event.stop_reason
    return _chunk(job, [choice], running)


def role_chunk(job: Job, index: int, running: dict[str, int] | None = None) -> dict[str, Any]:
    """A chat stream's first chunk of each choice (OpenAI's shape)."""
    delta = {"role": "assistant", "content": ""}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return _chunk(job, [choice], running)


def usage_chunk(job: Job, usages: list[Usage]) -> dict[str, Any]:
    return {**_head(job, chunk=True), "choices": [], "usage": usage(usages)}


def _chunk(job: Job, choices: list[dict[str, Any]], running: dict[str, int] | None):
    body = {**_head(job, chunk=True), "choices": choices}
    if job.include_usage:  # OpenAI: null on every chunk but the last; vLLM: the usage so far
        body["usage"] = running
    return body


def logprobs(
    job: Job, event: GenerateEvent, texts: TokenTexts, text_offset: int = 0
) -> dict[str, Any] | None:
    if job.top_logprobs is None or event.logprobs is None:
        return None
    if job.kind == "chat":
        return {"content": [_chat_logprob(lp, texts) for lp in event.logprobs]}
    return _completion_logprobs(event.logprobs, texts, text_offset)


def _chat_logprob(lp: TokenLogprob, texts: TokenTexts) -> dict[str, Any]:
    top = [_token(tid, tlp, texts) for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs)]
    return {**_token(lp.token_id, lp.logprob, texts), "top_logprobs": top}


def _token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def num_chars(event: GenerateEvent, texts: TokenTexts) -> int:
    """How far the event moves `text_offset`: its tokens' texts, as the offsets count them."""
    if event.logprobs is None:
        return len(event.text)
    return sum(len(texts.text(lp.token_id)) for lp in event.logprobs)


def _completion_logprobs(lps: list[TokenLogprob], texts: TokenTexts, offset: int):
    tokens = [texts.text(lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [
        {texts.text(tid): tlp for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs)} for lp in lps
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": top,
        "text_offset": offsets,
    }
