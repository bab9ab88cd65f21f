"""Size limits on a structured-outputs spec, checked on the spec itself before any compile.

llguidance compiles recursively: a ~3,000-rule chain (Lark, GBNF, or a JSON schema whose
`$ref`s chain through 3,000 `$defs`) overflows its stack and kills the process, and a few
`pattern`s intersected by `allOf` can allocate without bound. These checks are plain walks
over the spec (milliseconds, no recursion deeper than the limits), so an oversized grammar is
a 400 naming the limit before it reaches a compiler. The limits' defaults pass realistic
schemas (OpenAI tool schemas, nested Pydantic models through `$defs`).
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from kvpager.engine.structured.regex_limits import max_repeat
from kvpager.engine.structured.schema_limits import SchemaWalk
from kvpager.schemas.errors import ConfigError, InvalidRequestError
from kvpager.schemas.sampling import StructuredOutputsParams

# a Lark rule or terminal (`name:`, `?name:`, `NAME.2:`) or a GBNF rule (`name ::=`)
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w-]*(\.\d+)?\s*(:|::=)", re.MULTILINE)
_BOUND = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


@dataclass(frozen=True)
class GrammarLimits:
    """How large a spec may be, and the compile worker's budgets (engine/structured/
    compile_pool.py). Settings: `--grammar-max-*`, `--grammar-compile-*`."""

    max_bytes: int = 65536  # the grammar, schema, regex or choices' text
    max_rules: int = 1000  # Lark/GBNF rules and terminals; a schema's $defs
    max_depth: int = 128  # a schema's nesting plus its $ref hops, along any path
    max_alternatives: int = 1000  # `|`s of a grammar, choices, one anyOf/oneOf/allOf's size
    max_subschemas: int = 10000  # every schema object in a JSON schema
    max_patterns: int = 16  # `pattern`s (and patternProperties) in a JSON schema
    max_repeat: int = 10000  # a regex bound {n,m}, and the product of nested ones
    compile_timeout: float = 10.0  # seconds one compile may take in the worker
    compile_memory: int = 1 << 30  # bytes of address space of a compile worker
    compile_workers: int = 2  # processes compiling at once (gateway, tokenizer)

    def __post_init__(self) -> None:
        for name in (
            "max_bytes",
            "max_rules",
            "max_depth",
            "max_alternatives",
            "max_subschemas",
            "max_patterns",
            "max_repeat",
            "compile_workers",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"grammar_{name}: must be at least 1")
        if self.compile_timeout <= 0:
            raise ConfigError("grammar_compile_timeout: must be positive")
        if self.compile_memory < 256 << 20:
            raise ConfigError("grammar_compile_memory: at least 256MiB (Python's own share)")


DEFAULT_LIMITS = GrammarLimits()


def check_spec(spec: StructuredOutputsParams, limits: GrammarLimits) -> None:
    """Raise InvalidRequestError naming the field and the limit when `spec` is over one."""
    kind = spec.kind
    if kind == "json":
        check_schema_text(spec.json, limits)
    elif kind == "regex":
        _check_size(kind, len(spec.regex.encode()), limits)
        check_regex(kind, spec.regex, limits)
    elif kind == "choice":
        _check_size(kind, sum(len(c.encode()) for c in spec.choice), limits)
        _check_count(kind, "choices", len(spec.choice), limits.max_alternatives, "alternatives")
    elif kind == "grammar":
        check_grammar_text(spec.grammar, limits)


def check_schema_text(text: str, limits: GrammarLimits) -> None:
    """A JSON schema as text: its size first, then (parsed) its shape."""
    _check_size("json", len(text.encode()), limits)
    try:
        schema = json.loads(text)
    except RecursionError:
        raise over_limit("json", "nesting", limits.max_depth, "depth") from None
    except ValueError:
        return  # not JSON: the compile names it
    check_schema(schema, limits)


def check_schema(schema: Any, limits: GrammarLimits, kind: str = "json") -> None:
    """A parsed JSON schema's depth (with $ref hops), sizes, patterns and integers."""
    walk = SchemaWalk(schema, limits)
    try:
        problem = walk.run()
    except RecursionError:  # a max_depth set past Python's own recursion limit
        raise over_limit(kind, "nesting (with $ref hops)", limits.max_depth, "depth") from None
    if problem is not None:
        raise over_limit(kind, *problem)
    for pattern in walk.patterns:
        check_regex(kind, pattern, limits)


def check_grammar_text(text: str, limits: GrammarLimits) -> None:
    """A Lark or GBNF grammar: size, rules, alternatives and repetition bounds."""
    _check_size("grammar", len(text.encode()), limits)
    _check_count("grammar", "rules", len(_RULE.findall(text)), limits.max_rules, "rules")
    alternatives = text.count("|")
    _check_count("grammar", "alternatives", alternatives, limits.max_alternatives, "alternatives")
    for match in _BOUND.finditer(text):
        bound = max(int(value) for value in match.groups() if value)
        _check_count("grammar", "a repetition bound", bound, limits.max_repeat, "repeat")
    check_regex("grammar", text, limits)  # nested bounds inside its regex terminals


def check_regex(kind: str, pattern: str, limits: GrammarLimits) -> None:
    """A regex's largest repetition: one bound, or the product of nested ones."""
    product = max_repeat(pattern)
    _check_count(kind, "a regex repetition", product, limits.max_repeat, "repeat")


def _check_size(kind: str, num_bytes: int, limits: GrammarLimits) -> None:
    _check_count(kind, "size in bytes", num_bytes, limits.max_bytes, "bytes")


def _check_count(kind: str, what: str, value: int, limit: int, name: str) -> None:
    if value > limit:
        raise over_limit(kind, what, limit, name)


def over_limit(kind: str, what: str, limit: int, name: str) -> InvalidRequestError:
    """The 400 of a spec over a limit, naming the setting that raises it."""
    param = f"structured_outputs.{kind}"
    if name == "integer-bits":  # a fixed limit: llguidance reads integers as 64-bit
        return InvalidRequestError(f"{param}: {what} (integers must fit in 64 bits)", param)
    flag = f"--grammar-max-{name}"
    message = f"{param}: {what} is over the server's limit of {limit} ({flag})"
    return InvalidRequestError(message, param=param)
