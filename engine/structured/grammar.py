"""Grammars for structured outputs, compiled by llguidance against one tokenizer.

    StructuredOutputsParams --grammar_text()--> llguidance grammar (JSON or Lark text)
        --GrammarCompiler.matcher()--> a fresh LLMatcher (a copy of a cached compiled one)

llguidance was chosen over xgrammar (benchmarks/structured_backend.py): it has no
dependencies (xgrammar's pull another torch), compiles a schema faster (what a request without
a cache hit waits for), computes a mask in a small part of a step, and fills plain `bytes`,
so nothing here needs torch. A matcher's mask is packed int32 words, bit i of word w set when
token 32 * w + i may come next; once the grammar is complete it allows only EOS, so a request
ends by EOS ("stop"), as in vLLM.
"""

import hashlib
import json
from collections import OrderedDict

import llguidance
import msgspec
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.sampling import StructuredOutputsParams
from llguidance.gbnf_to_lark import any_to_lark

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (per tokenizer)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: fewer tokens to sample


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's own budgets, a smaller grammar size than its default (500,000 symbols):
    the size checks (engine/structured/limits.py) pass far less than this already."""
    return llguidance.LLParserLimits(max_grammar_size=200_000)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec; raises InvalidRequestError naming the field when
    the spec cannot even be read (a schema that is not JSON)."""
    kind = spec.kind
    if kind == "json":
        try:
            schema = json.loads(spec.json)
        except (ValueError, RecursionError) as exc:
            raise _invalid("json", f"not valid JSON: {exc!r}") from exc
        if not isinstance(schema, dict | bool):
            raise _invalid("json", "a JSON schema is an object")
        try:  # a schema it cannot read (an integer past 64 bits, ...) is the client's error
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except Exception as exc:
            raise _invalid("json", str(exc)) from exc
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:  # Lark, or GBNF (llama.cpp's, which vLLM's xgrammar backend takes): converted
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    except Exception as exc:  # the converter raises its own parse errors
        raise _invalid("grammar", str(exc)) from exc


def validate(spec: StructuredOutputsParams) -> None:
    """Compile-check a spec without a tokenizer (what the HTTP gateway can do): raises
    InvalidRequestError naming `structured_outputs.<field>`."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec), limits=parser_limits())
    if error and not error.startswith("WARNING"):
        raise _invalid(spec.kind, error)


def _invalid(kind: str, message: str) -> InvalidRequestError:
    param = f"structured_outputs.{kind}"
    return InvalidRequestError(f"{param}: cannot be compiled: {message}", param=param)


class GrammarCompiler:
    """Compiles specs for one tokenizer, with an LRU cache of compiled matchers keyed by the
    spec (the tokenizer is the compiler's own), each request getting a copy."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: masks are cut to it
        self.num_words = -(-vocab_size // 32)
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0

    @classmethod
    def from_tokenizer_json(
        cls, tokenizer_json: str, vocab_size: int, eos_token_id: int
    ) -> "GrammarCompiler":
        """From a `tokenizer.json` text (the executor's model folder)."""
        tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id
        )
        return cls(tokenizer, vocab_size)

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int) -> "GrammarCompiler":
        """From a transformers fast tokenizer (the front doors' own)."""
        import llguidance.hf

        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size), vocab_size)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile (or find) the spec's grammar; InvalidRequestError naming the field if it
        cannot be compiled."""
        self._compiled(spec)

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sample, at the grammar's start."""
        return self._compiled(spec).deep_copy()

    def _compiled(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = spec_key(spec)
        template = self._cache.get(key)
        if template is not None:
            self._cache.move_to_end(key)
            return template
        text = grammar_text(spec)
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        if template.is_error():
            raise _invalid(spec.kind, template.get_error())
        self.num_compiled += 1
        self._cache[key] = template
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return template


def spec_key(spec: StructuredOutputsParams) -> bytes:
    """A spec's cache key: the sha256 of its msgpack bytes (32 bytes, whatever its size)."""
    return hashlib.sha256(msgspec.msgpack.encode(spec)).digest()


def fill_bitmask(matcher: llguidance.LLMatcher, num_words: int) -> bytes | None:
    """The packed int32 mask of the tokens `matcher` allows next, `num_words` words long;
    None when the matcher is in error (a limit hit, a refused token): its request must end
    with an error, never go on unconstrained."""
    if matcher.is_error():
        return None
    mask = matcher.compute_bitmask()[: 4 * num_words]
    return None if matcher.is_error() else mask
