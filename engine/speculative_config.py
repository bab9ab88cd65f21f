"""Speculative decoding's configuration (vLLM's `speculative_config`), checked once."""

import json
from dataclasses import dataclass, fields

from kvpager.schemas.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
_SPECULATIVE_FLOATS = (
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "min_acceptance_rate",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names. `method` "ngram" (prompt lookup) proposes up to
    `num_speculative_tokens` tokens a step from the longest suffix n-gram (`prompt_lookup_max`
    down to `prompt_lookup_min` tokens) found earlier in the sequence; "suffix" (suffix
    decoding, Arctic Inference's) proposes the most frequent continuation of the longest
    suffix (up to `suffix_decoding_max_tree_depth` tokens) found in the sequence or in the
    outputs of the last `suffix_decoding_max_cached_requests` requests, as long as its
    estimated probability stays at least `suffix_decoding_min_token_prob` and its length at
    most `suffix_decoding_max_spec_factor` x the match length; "draft_model" (given a `model`
    path alone, as vLLM infers it) runs that smaller model of the same vocabulary and head
    shapes as a second decoder whose K/V sits in extra layer slots of the same paged blocks
    (engine/worker/spec_decode/draft_model.py), proposing its next k tokens.

    Switching off: speculation steps aside for a step when more than
    `max_num_seqs_to_speculate` sequences run (vLLM's `disable_by_batch_size` is read as this),
    and for a request's next 64 tokens when fewer than `min_acceptance_rate` of its last 32
    proposed tokens were accepted (engine/sched/lookahead.py)."""

    method: str = "ngram"
    model: str | None = None  # the draft model's path, for "draft_model"
    # None: 4 for ngram, the tree depth for suffix (vLLM's defaults)
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Measured on SmolLM2 (CPU, benchmarks/spec_decode.py) is left to the lead; 8 is cautious.
    max_num_seqs_to_speculate: int = 8
    min_acceptance_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method: {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model: give it for method draft_model only")
        self._check_suffix()
        if self.num_speculative_tokens is None:
            default = 4 if self.method == "ngram" else self.suffix_decoding_max_tree_depth
            object.__setattr__(self, "num_speculative_tokens", min(default, 32))
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError("speculative_config.num_speculative_tokens: must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64"
            )
        if self.max_num_seqs_to_speculate < 1:
            raise ConfigError("speculative_config.max_num_seqs_to_speculate: must be >= 1")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ConfigError("speculative_config.min_acceptance_rate: must be in [0, 1]")

    def _check_suffix(self) -> None:
        prefix = "speculative_config.suffix_decoding_"
        if not 1 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ConfigError(f"{prefix}max_tree_depth: must be in [1, 256]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError(f"{prefix}max_cached_requests: must be >= 0 (0: no global cache)")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError(f"{prefix}max_spec_factor: must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError(f"{prefix}min_token_prob: must be in [0, 1]")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict of its fields, a JSON object, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: give an object of its fields")
        if "model" in value and "method" not in value:  # vLLM infers the method
            value = {**value, "method": "draft_model"}
        if value.get("method", "ngram") not in SPECULATIVE_METHODS:
            cls(method=str(value["method"]))  # raises, naming what is supported
        value = _read_disable_by_batch_size(dict(value))
        names = {spec.name for spec in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown fields {unknown}; known {sorted(names)}"
            )
        _check_types(value)
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({spec.name: getattr(self, spec.name) for spec in fields(self)})


def _read_disable_by_batch_size(value: dict) -> dict:
    """vLLM's `disable_by_batch_size` (off when more requests run) is our
    `max_num_seqs_to_speculate`; both given must agree."""
    if "disable_by_batch_size" not in value:
        return value
    size = value.pop("disable_by_batch_size")
    if value.setdefault("max_num_seqs_to_speculate", size) != size:
        raise ConfigError(
            "speculative_config: disable_by_batch_size and max_num_seqs_to_speculate differ"
        )
    return value


def _check_types(value: dict) -> None:
    floats = [k for k in _SPECULATIVE_FLOATS if k in value]
    not_numbers = [k for k in floats if type(value[k]) not in (int, float)]
    if not_numbers:
        raise ConfigError(f"speculative_config: {not_numbers} must be numbers")
    if value.get("model") is not None and type(value["model"]) is not str:
        raise ConfigError("speculative_config: model must be a path")
    ints = [k for k, v in value.items() if k not in ("method", "model") and k not in floats]
    ints = [k for k in ints if type(value[k]) is not int]
    if ints:
        raise ConfigError(f"speculative_config: {ints} must be integers")
