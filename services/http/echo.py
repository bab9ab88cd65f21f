"""The prompt in a response: completions' `echo` (OpenAI's legacy API, as vLLM has it) and
vLLM's `prompt_logprobs` field.

A stream's first event brings its prompt's token ids and text (with echo) and the prompt's
logprobs (when asked); each choice of that prompt shows them once, in its first chunk (or its
whole response). Logprobs below -9999 are written -9999, as vLLM does (JSON has no -inf).
"""

from dataclasses import dataclass
from typing import Any

from kvpager.schemas.public import GenerateEvent, PromptLogprob
from kvpager.services.http.tokens import TokenTexts, text_offsets

MIN_LOGPROB = -9999.0


@dataclass
class PromptInfo:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: list[PromptLogprob | None] | None = None


class Prompts:
    """What the streams said about their prompts, by prompt index; which choices showed it."""

    def __init__(self) -> None:
        self.by_index: dict[int, PromptInfo] = {}
        self._shown: set[int] = set()  # choices

    def add(self, prompt_index: int, event: GenerateEvent) -> None:
        if event.prompt_token_ids is None and event.prompt_logprobs is None:
            return
        info = self.by_index.setdefault(prompt_index, PromptInfo())
        if event.prompt_token_ids is not None:
            info.text, info.token_ids = event.prompt_text or "", tuple(event.prompt_token_ids)
        if event.prompt_logprobs is not None:  # a long prompt's come over several events
            info.logprobs = (info.logprobs or []) + event.prompt_logprobs

    def first_show(self, choice: int, prompt_index: int) -> PromptInfo | None:
        """The prompt, the first time `choice` asks; None after that."""
        if choice in self._shown:
            return None
        self._shown.add(choice)
        return self.by_index.get(prompt_index, PromptInfo())


def legacy_logprobs(
    info: PromptInfo, texts: TokenTexts, offset: int = 0
) -> tuple[dict[str, list], int]:
    """The prompt's tokens in completions' logprobs object: null first, then each token's
    logprob and {text: logprob} of the token itself and its top alternatives; and the text
    offset after them."""
    tokens = [texts.text(token_id) for token_id in info.token_ids]
    offsets, offset = text_offsets(tokens, offset)
    logprobs = info.logprobs or [None] * len(tokens)
    token_logprobs: list[float | None] = [None]
    top: list[dict[str, float] | None] = [None]
    for lp in logprobs[1 : len(tokens)]:
        token_logprobs.append(_clamped(lp.logprob) if lp else None)
        top.append(_top(lp, texts) if lp else None)
    legacy = {
        "tokens": tokens,
        "token_logprobs": token_logprobs[: len(tokens)],
        "top_logprobs": top[: len(tokens)],
        "text_offset": offsets,
    }
    return legacy, offset


def num_chars(info: PromptInfo | None, texts: TokenTexts, with_logprobs: bool) -> int:
    """How far an echoed prompt moves the choice's text offset."""
    if info is None:
        return 0
    if not with_logprobs:
        return len(info.text)
    return sum(len(texts.text(token_id)) for token_id in info.token_ids)


def _top(lp: PromptLogprob, texts: TokenTexts) -> dict[str, float]:
    top = {texts.text(lp.token_id): _clamped(lp.logprob)}
    for token_id, logprob in zip(lp.top_token_ids, lp.top_logprobs):
        top.setdefault(texts.text(token_id), _clamped(logprob))
    return top


def vllm_prompt_logprobs(
    logprobs: list[PromptLogprob | None] | None, texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null first, then {token id: {logprob, rank,
    decoded_token}} of the token itself and its top alternatives."""
    if logprobs is None:
        return None
    return [None if lp is None else _vllm_entry(lp, texts) for lp in logprobs]


def _vllm_entry(lp: PromptLogprob, texts: TokenTexts) -> dict[str, dict[str, Any]]:
    entry = {str(lp.token_id): _vllm_logprob(lp.logprob, lp.rank, lp.token_id, texts)}
    ranked = enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)
    for rank, (token_id, logprob) in ranked:
        entry.setdefault(str(token_id), _vllm_logprob(logprob, rank, token_id, texts))
    return entry


def _vllm_logprob(logprob: float, rank: int, token_id: int, texts: TokenTexts) -> dict[str, Any]:
    return {"logprob": _clamped(logprob), "rank": rank, "decoded_token": texts.text(token_id)}


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
