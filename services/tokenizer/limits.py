"""The tokenizer service's caps on one request, enforced before it spends work on it: the body
size before parsing, the fields before tokenizing, the prompt's length once tokenized. Each
violation is an InvalidRequestError naming the field (RequestTooLongError for the prompt), so
a client gets one typed error. The offline LLM has none of these: they are a server's.
"""

from dataclasses import dataclass, fields
from typing import Any

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

    def check_fields(self, request: GenerateRequest) -> None:
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
