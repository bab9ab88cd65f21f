"""The tokenizer service's caps on one request, enforced before it spends work on it: the body
size before parsing, the fields before tokenizing, the prompt's length once tokenized. Each
violation is an InvalidRequestError naming the field (RequestTooLongError for the prompt), so
a client gets one typed error. The offline LLM has none of these: they are a server's.

Some caps keep every internal message within the wire's limit (services/fit.py cuts the rest):
one sequence's sampling params travel whole in each step that (re)starts it, and one beam row's
candidates travel whole in the step's output.
"""

from dataclasses import dataclass, fields
from typing import Any

from kvpager.engine.sched.beam_search import num_candidates
from kvpager.schemas.errors import ConfigError, InvalidRequestError, RequestTooLongError
from kvpager.schemas.public import GenerateRequest
from kvpager.schemas.sampling import SamplingParams
from kvpager.services.wire import pack


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: only the scheduler's max_model_len
    max_output_tokens: int | None = None
    max_n: int = 16
    max_beam_width: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_beam_candidates: int = 1024  # one beam row's candidates in a step's output
    max_prompt_logprob_values: int = 1 << 18  # (prompt_logprobs + 1) x prompt tokens
    max_sampling_params_bytes: int = 256 << 10  # their msgpack size, in every internal message
    max_logprobs: int = 20  # logprobs and prompt_logprobs (vLLM's --max-logprobs)
    max_logit_bias: int = 300  # logit_bias entries (OpenAI's bound)

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
        _at_most("logprobs", request.logprobs or 0, self.max_logprobs, "logprobs")
        _at_most("prompt_logprobs", request.prompt_logprobs or 0, self.max_logprobs, "logprobs")
        num_ids = len(request.stop_token_ids)
        _at_most("stop_token_ids", num_ids, self.max_stop_token_ids, "stop token ids")
        num_biased = len(request.logit_bias or {})
        _at_most("logit_bias", num_biased, self.max_logit_bias, "logit_bias entries")

    def check_params(self, params: SamplingParams) -> None:
        """What the sampling params put on the wire: their own size, and beam candidates."""
        num_bytes = len(pack(params))
        _at_most(
            "structured_outputs" if params.structured_outputs else "stop",
            num_bytes,
            self.max_sampling_params_bytes,
            "bytes of sampling parameters",
        )
        if params.is_beam_search:
            candidates = num_candidates(params, eos_ids=())  # the model's EOS ids come on top
            _at_most(
                "stop_token_ids",
                candidates,
                self.max_beam_candidates,
                "beam candidates per beam (beam_width + distinct stop token ids)",
            )

    def check_prompt_logprobs(self, params: SamplingParams, num_tokens: int) -> None:
        if params.prompt_logprobs is None:
            return
        values = (params.prompt_logprobs + 1) * num_tokens
        _at_most(
            "prompt_logprobs",
            values,
            self.max_prompt_logprob_values,
            "prompt logprob values ((prompt_logprobs + 1) x prompt tokens)",
        )

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
