"""The input path shared by both front doors: prompts in, checked token ids out.

`InputProcessor` tokenizes a prompt, applies the chat template to messages, and checks the
token ids against the vocabulary and the caps; the offline `LLM` and the tokenizer service
both call it. `RequestLimits` are the per-request caps a server enforces before it spends work
on a request: the body size before parsing (tokenizer service), the fields before tokenizing,
the prompt's length once tokenized. Each violation is an InvalidRequestError naming the field
(RequestTooLongError for the prompt), so a client gets one typed error.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from transformers import PreTrainedTokenizerBase

from schemas.errors import ConfigError, InvalidRequestError, RequestTooLongError
from schemas.public import GenerateRequest


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: only the scheduler's max_model_len
    max_output_tokens: int | None = None
    max_n: int = 16
    max_beam_width: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None and value < 1:
                raise ConfigError(f"{spec.name}: must be at least 1")

    @classmethod
    def from_settings(cls, settings: Any) -> "RequestLimits":
        return cls(**{spec.name: getattr(settings, spec.name) for spec in fields(cls)})

    def check_body(self, body: bytes) -> None:
        if len(body) > self.max_request_bytes:
            raise InvalidRequestError(
                f"request body: {len(body)} bytes exceed the limit ({self.max_request_bytes})"
            )

    def check_request(self, request: GenerateRequest) -> None:
        _at_most("max_tokens", request.max_tokens, self.max_output_tokens)
        _at_most("n", request.n, self.max_n)
        _at_most("beam_width", request.beam_width, self.max_beam_width)
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        _at_most("stop", len(stop), self.max_stop_strings, "stop strings")
        longest = max((len(s) for s in stop), default=0)
        _at_most("stop", longest, self.max_stop_string_chars, "characters")

    def check_prompt(self, num_tokens: int, param: str) -> None:
        limit = self.max_prompt_tokens
        if limit is not None and num_tokens > limit:
            raise RequestTooLongError(
                f"{param}: {num_tokens} prompt tokens exceed the limit ({limit})", param=param
            )


def _at_most(param: str, value: int, limit: int | None, unit: str = "") -> None:
    if limit is not None and value > limit:
        amount = f"{value} {unit}".rstrip()
        raise InvalidRequestError(
            f"{param}: {amount} is over this server's limit ({limit})", param=param
        )


class InputProcessor:
    """Token ids for a prompt, a conversation or given ids, checked; `limits` None: no caps."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        limits: RequestLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits

    def prompt_ids(
        self, prompt: str | Sequence[int], param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """A text prompt tokenized as is (with the tokenizer's BOS etc. unless told not to), or
        given token ids, checked."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            token_ids = list(prompt)
        return self.checked(token_ids, param)

    def chat_ids(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A conversation rendered with the model's chat template, by default ready for a
        reply; the template writes its own special tokens, `add_special_tokens` adds the
        tokenizer's on top (vLLM's /tokenize option)."""
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("messages: this model has no chat template", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template may raise on roles it does not know
            raise InvalidRequestError(f"messages: {exc}", param="messages") from exc
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.checked(token_ids, "messages")

    def checked(self, token_ids: list[int], param: str) -> list[int]:
        """Non-empty, every id in the vocabulary, within the prompt cap."""
        if not token_ids:
            raise InvalidRequestError(f"{param}: must not be empty", param=param)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab})", param)
        if self.limits is not None:
            self.limits.check_prompt(len(token_ids), param)
        return token_ids
