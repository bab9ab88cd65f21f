"""The caps on one request a server enforces (services/tokenizer/limits.py) and the
structured-outputs grammar limits (engine/structured/limits.py), as settings: a part of
`Settings` (services/settings.py) kept in its own module, flags and variables alike."""

import dataclasses
from dataclasses import dataclass

from kvpager.engine.structured.limits import GrammarLimits
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.sampling import MAX_NUM_LOGPROBS
from kvpager.services.options import ByteSize, option


@dataclass(frozen=True)
class RequestCaps:
    """Request caps and grammar limits; `Settings` has them as its own fields."""

    max_request_bytes: int = option("largest request body, checked unread", default=1 << 20)
    max_prompt_tokens: int | None = option(
        "longest prompt (default: the model's context length)", default=None
    )
    max_output_tokens: int | None = option("largest max_tokens (default: no cap)", default=None)
    max_n: int = option("most samples (n) per request", default=16)
    max_beam_width: int = option("widest beam search per request", default=16)
    max_stop_strings: int = option("most stop strings per request", default=16)
    max_stop_string_chars: int = option("longest stop string (characters)", default=256)
    allow_special_tokens_in_content: bool = option(
        "tokenize special-token text inside chat messages and tools (<|im_start|> ...) as the "
        "real tokens, as vLLM does (default: refused with a 400 naming the message)",
        default=False,
    )
    grammar_max_bytes: int = option(
        "structured outputs: largest grammar, JSON schema, regex or choice list (bytes)",
        default=GrammarLimits.max_bytes,
    )
    grammar_max_rules: int = option(
        "structured outputs: most rules of a Lark/GBNF grammar, or $defs of a JSON schema",
        default=GrammarLimits.max_rules,
    )
    grammar_max_depth: int = option(
        "structured outputs: deepest JSON schema, its nesting plus $ref hops",
        default=GrammarLimits.max_depth,
    )
    grammar_max_alternatives: int = option(
        "structured outputs: most `|` of a grammar, choices, or entries of one anyOf/oneOf/allOf",
        default=GrammarLimits.max_alternatives,
    )
    grammar_max_subschemas: int = option(
        "structured outputs: most schema objects in one JSON schema",
        default=GrammarLimits.max_subschemas,
    )
    grammar_max_patterns: int = option(
        "structured outputs: most `pattern`s (and patternProperties) in one JSON schema",
        default=GrammarLimits.max_patterns,
    )
    grammar_max_repeat: int = option(
        "structured outputs: largest regex repetition {n,m}, also as a product of nested ones",
        default=GrammarLimits.max_repeat,
    )
    grammar_compile_timeout: float = option(
        "structured outputs: seconds one grammar may take to compile (else a 400)",
        default=GrammarLimits.compile_timeout,
    )
    grammar_compile_memory: ByteSize = option(
        "structured outputs: address space of a grammar compile worker process, e.g. 1GiB",
        default=ByteSize(GrammarLimits.compile_memory),
    )
    grammar_compile_workers: int = option(
        "structured outputs: compile worker processes per gateway and per tokenizer",
        default=GrammarLimits.compile_workers,
    )
    max_stop_token_ids: int = option("most stop_token_ids per request", default=256)
    max_logit_bias: int = option("most logit_bias entries per request (OpenAI's)", default=300)
    max_logprobs: int = option(
        "most logprobs / prompt_logprobs one request may ask for (vLLM's flag; past it, a 400)",
        default=MAX_NUM_LOGPROBS,
    )
    max_beam_candidates: int = option(
        "most candidates one beam row returns per step (beam_width + stop token ids)",
        default=1024,
    )
    max_prompt_logprob_values: int = option(
        "most prompt logprob values per request: (prompt_logprobs + 1) x prompt tokens",
        default=1 << 18,
    )
    max_sampling_params_bytes: int = option(
        "largest sampling parameters (stop strings, schema...) as sent between services",
        default=256 << 10,
    )

    def _check_caps(self) -> None:
        if not 1 <= self.max_logprobs <= MAX_NUM_LOGPROBS:
            raise ConfigError(f"max_logprobs: must be in [1, {MAX_NUM_LOGPROBS}]")
        _ = self.grammar_limits  # raises ConfigError naming a grammar limit out of range

    @property
    def grammar_limits(self) -> GrammarLimits:
        """The structured-outputs limits (engine/structured/limits.py)."""
        names = [f.name for f in dataclasses.fields(GrammarLimits)]
        return GrammarLimits(**{name: getattr(self, f"grammar_{name}") for name in names})
