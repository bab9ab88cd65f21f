"""SamplingParams: how to sample one request, validated on construction and on decode.

A msgspec Struct so the same object is the engine's API, the wire form the executor receives,
and the fields a client sends. Names and defaults follow vLLM's `SamplingParams`.
"""

import json as json_module
import math
from typing import Any

import msgspec
from kvpager.schemas.errors import InvalidRequestError

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar past this is refused, not compiled
MAX_CHOICES = 1024
MAX_NUM_LOGPROBS = 20  # top alternatives a token's logprobs may list (sampled and prompt)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one token's bias: [-100, 100]


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Constrain the output to a JSON schema, a regex, one of some strings, a Lark grammar, or
    any JSON object: exactly one of them (vLLM's `StructuredOutputsParams`).

    Only strings and lists: `json` is the schema's JSON text (a dict given in Python is
    serialised on construction), so the struct crosses NATS as plain msgpack.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's), as vLLM's guidance backend takes
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict | bool):  # the offline API's convenience
            self.json = json_module.dumps(self.json)
        given = [
            name for name in self.__struct_fields__ if getattr(self, name) not in (None, False)
        ]
        _check(
            len(given) == 1,
            "structured_outputs",
            f"exactly one of json, regex, choice, grammar or json_object, got {given or 'none'}",
        )
        text = self.json or self.regex or self.grammar or ""
        _check(
            len(text) <= MAX_SPEC_CHARS,
            f"structured_outputs.{given[0]}",
            f"at most {MAX_SPEC_CHARS} characters",
        )
        if self.choice is not None:
            _check(
                0 < len(self.choice) <= MAX_CHOICES and all(self.choice),
                "structured_outputs.choice",
                f"1 to {MAX_CHOICES} non-empty strings",
            )
            _check(
                sum(map(len, self.choice)) <= MAX_SPEC_CHARS,
                "structured_outputs.choice",
                f"at most {MAX_SPEC_CHARS} characters in all",
            )

    @property
    def kind(self) -> str:
        """The one field given: json, regex, choice, grammar or json_object."""
        return next(n for n in self.__struct_fields__ if getattr(self, n) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    # Output positions an earlier run of this request already sampled (a migrated stream,
    # re-sent with those tokens appended to its prompt): this run's first token draws from
    # (seed, seed_offset). Only seeded sampling reads it.
    seed_offset: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    # vLLM's: per prompt token from the second on, its logprob, rank and this many top
    # alternatives (computed during prefill; the request skips the prefix cache)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's: token id -> a value added to its logit before sampling (and before logprobs);
    # -100 bans a token, +100 all but forces it. Ids are checked against the vocabulary on the
    # input path (engine/frontend/inputs.py), which knows it.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_ranges()
        self._check_beam_search()
        self._check_structured()

    def _check_ranges(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "length_penalty",
        ):
            _check(math.isfinite(getattr(self, name)), name, "must be a finite number")
        _check(self.n >= 1, "n", "must be at least 1")
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        # vLLM bounds it nowhere; past +-10, length ** length_penalty overflows a float at
        # lengths a context can hold, and no useful search needs more
        _check(-10.0 <= self.length_penalty <= 10.0, "length_penalty", "must be in [-10, 10]")
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            in_range = value is None or 0 <= value <= MAX_NUM_LOGPROBS
            _check(in_range, name, f"must be in [0, {MAX_NUM_LOGPROBS}]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        _check(0 <= self.seed_offset < 2**31, "seed_offset", "must be in [0, 2**31)")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"token id {token_id} must be >= 0")
            in_range = math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            _check(in_range, "logit_bias", f"{token_id}: {bias} is not in [-100, 100]")

    def _check_structured(self) -> None:
        if self.structured_outputs is None:
            return
        # a complete grammar allows only EOS: a ban on it would leave no token to sample
        _check(self.min_tokens == 0, "min_tokens", "is not supported with structured_outputs")

    def _check_beam_search(self) -> None:
        _check(self.beam_width >= 1, "beam_width", "must be at least 1")
        if self.beam_width == 1:
            return
        _check(self.n <= self.beam_width, "n", "must be <= beam_width in beam search")
        _check(self.temperature == 0.0, "temperature", "beam search is greedy: use 0")
        for name, neutral in (
            ("top_p", 1.0),
            ("min_p", 0.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            _check(getattr(self, name) == neutral, name, "is not supported with beam search")
        _check(self.top_k in (0, -1), "top_k", "is not supported with beam search")
        _check(not self.stop, "stop", "stop strings are not supported with beam search")
        _check(not self.logit_bias, "logit_bias", "is not supported with beam search")
        _check(
            self.structured_outputs is None,
            "structured_outputs",
            "is not supported with beam search",
        )
        no_prompt_logprobs = self.prompt_logprobs is None
        _check(no_prompt_logprobs, "prompt_logprobs", "is not supported with beam search")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "SamplingParams":
        """Build from a plain mapping; unknown fields and wrong types raise InvalidRequestError."""
        for name in fields:
            _check(name in cls.__struct_fields__, name, "unknown sampling field")
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            param = _param_of(str(exc))
            raise InvalidRequestError(str(exc), param=param) from exc


def _param_of(message: str) -> str | None:
    """The failing field: msgspec ends type errors with `$.field`; our checks start `field:`."""
    marker = "$."
    if marker in message:
        return message.rsplit(marker, 1)[1].split("[")[0].split(".")[0].rstrip("`'\" ")
    head = message.split(":", 1)[0]
    return head if head in SamplingParams.__struct_fields__ else None
