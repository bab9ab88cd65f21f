"""kvpager's GenerateEvents in OpenAI's shapes: whole responses, stream chunks, usage, logprobs.

A choice is one sample of one prompt: `index = prompt_index * n + sample_index`.
"""

from typing import Any

from kvpager.schemas.public import GenerateEvent, TokenLogprob, Usage
from kvpager.services.http import tool_output
from kvpager.services.http.echo import PromptInfo, Prompts, legacy_logprobs, vllm_prompt_logprobs
from kvpager.services.http.requests import Job
from kvpager.services.http.tokens import TokenTexts, text_offsets


def usage(usages: list[Usage], prompt_only: bool = False) -> dict[str, Any]:
    prompt = sum(u.num_prompt_tokens for u in usages)
    completion = 0 if prompt_only else sum(u.num_completion_tokens for u in usages)
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
        num_tokens = 0 if self.job.prompt_only else len(event.token_ids)
        self.completion[choice] = self.completion.get(choice, 0) + num_tokens

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


def whole(
    job: Job,
    finals: dict[int, GenerateEvent],
    usages: list[Usage],
    texts: TokenTexts,
    prompts: Prompts,
):
    """The response of `stream: false`: `finals` by choice index, each a sample's one event;
    `prompts`: what the streams said of their prompts."""
    choices = [_choice(job, i, finals[i], texts, prompts) for i in sorted(finals)]
    body = {**_head(job, chunk=False), "choices": choices, "usage": usage(usages, job.prompt_only)}
    if job.kind == "chat" and job.prompt_logprobs:  # vLLM's: beside the choices
        info = prompts.by_index.get(0, PromptInfo())
        body["prompt_logprobs"] = vllm_prompt_logprobs(info.logprobs, texts)
    return body


def _choice(
    job: Job, index: int, event: GenerateEvent, texts: TokenTexts, prompts: Prompts
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    shown = shown_prompt(job, prompts, index)
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": event.text}
    else:
        choice["text"] = _text(job, event, shown)
    choice["logprobs"] = logprobs(job, event, texts, 0, shown)
    _finish(job, choice, event)
    if job.tool_mode is not None:  # the answer's text becomes tool calls
        choice["message"], choice["finish_reason"] = tool_output.message(
            job.tool_mode, event.text, event.finish_reason
        )
    if job.kind == "completion" and job.prompt_logprobs:
        info = prompts.by_index.get(index // job.n, PromptInfo())
        choice["prompt_logprobs"] = vllm_prompt_logprobs(info.logprobs, texts)
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


def shown_prompt(job: Job, prompts: Prompts, choice: int) -> PromptInfo | None:
    """With echo, the prompt that `choice` shows now: the first time it is asked, else None."""
    if not job.echo:
        return None
    return prompts.first_show(choice, choice // job.n)


def _text(job: Job, event: GenerateEvent, shown: PromptInfo | None) -> str:
    text = "" if job.prompt_only else event.text
    return text if shown is None else shown.text + text


def _finish(job: Job, choice: dict[str, Any], event: GenerateEvent) -> None:
    """finish_reason and stop_reason; the prompt alone (max_tokens 0) ends by length."""
    if job.prompt_only and event.finish_reason not in (None, "error", "abort"):
        choice["finish_reason"], choice["stop_reason"] = "length", None
    else:
        choice["finish_reason"], choice["stop_reason"] = event.finish_reason, event.stop_reason


def chunk(
    job: Job,
    index: int,
    event: GenerateEvent,
    texts: TokenTexts,
    text_offset: int = 0,
    running: dict[str, int] | None = None,
    shown: PromptInfo | None = None,
) -> dict[str, Any]:
    """One stream event as a chunk of one choice; `text_offset`: the choice's text so far;
    `shown`: the echoed prompt, in the choice's first chunk."""
    choice: dict[str, Any] = {"index": index}
    if job.kind == "chat":
        choice["delta"] = {"content": event.text} if event.text else {}
    else:
        choice["text"] = _text(job, event, shown)
    choice["logprobs"] = logprobs(job, event, texts, text_offset, shown)
    _finish(job, choice, event)
    if event.finish_reason is None:
        del choice["stop_reason"]
    return _chunk(job, [choice], running)


def role_chunk(job: Job, index: int, running: dict[str, int] | None = None) -> dict[str, Any]:
    """A chat stream's first chunk of each choice (OpenAI's shape)."""
    delta = {"role": "assistant", "content": ""}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return _chunk(job, [choice], running)


def usage_chunk(job: Job, usages: list[Usage]) -> dict[str, Any]:
    return {**_head(job, chunk=True), "choices": [], "usage": usage(usages, job.prompt_only)}


def _chunk(job: Job, choices: list[dict[str, Any]], running: dict[str, int] | None):
    body = {**_head(job, chunk=True), "choices": choices}
    if job.include_usage:  # OpenAI: null on every chunk but the last; vLLM: the usage so far
        body["usage"] = running
    return body


def logprobs(
    job: Job,
    event: GenerateEvent,
    texts: TokenTexts,
    text_offset: int = 0,
    shown: PromptInfo | None = None,
) -> dict[str, Any] | None:
    """The event's logprobs object; with echo, the shown prompt's tokens come first."""
    if job.top_logprobs is None:
        return None
    if job.kind == "chat":
        if event.logprobs is None:
            return None
        return {"content": [_chat_logprob(lp, texts) for lp in event.logprobs]}
    generated = [] if job.prompt_only else event.logprobs
    if shown is None:
        return None if generated is None else _completion_logprobs(generated, texts, text_offset)
    legacy, offset = legacy_logprobs(shown, texts, text_offset)
    for name, values in _completion_logprobs(generated or [], texts, offset).items():
        legacy[name] += values
    return legacy


def _chat_logprob(lp: TokenLogprob, texts: TokenTexts) -> dict[str, Any]:
    top = [_token(tid, tlp, texts) for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs)]
    return {**_token(lp.token_id, lp.logprob, texts), "top_logprobs": top}


def _token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def num_chars(event: GenerateEvent, texts: TokenTexts, job: Job) -> int:
    """How far the event moves `text_offset`: its tokens' texts, as the offsets count them."""
    if job.prompt_only:
        return 0
    if event.logprobs is None:
        return len(event.text)
    return sum(len(texts.text(lp.token_id)) for lp in event.logprobs)


def _completion_logprobs(lps: list[TokenLogprob], texts: TokenTexts, offset: int):
    tokens = [texts.text(lp.token_id) for lp in lps]
    offsets, _ = text_offsets(tokens, offset)
    top = [
        {texts.text(tid): tlp for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs)} for lp in lps
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": top,
        "text_offset": offsets,
    }
