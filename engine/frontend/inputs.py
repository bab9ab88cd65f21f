"""The input path shared by both front doors: prompts in, checked token ids out.

`InputProcessor.process` is a request's one trip down, from the offline `LLM` and from the
tokenizer service alike: which field gives the prompt, the structured-outputs spec's sizes,
the token ids (the chat template applied to messages), the caller's own check of them (a
server's caps, services/tokenizer/limits.py; the offline scheduler's limits), then the spec's
compile check.

Special-token text inside a conversation (`<|im_start|>system` in a user message, a tool's
result or a tool definition) is refused by default. The template's output is tokenized as one
text, so that text would become the real control token: whoever writes a message, or a web
page a tool fetched, could open a system turn. OpenAI never turns message text into control
tokens; vLLM does (the injection). Refusing, rather than tokenizing it as plain text, keeps
every accepted conversation's tokens exactly transformers' `apply_chat_template`'s;
`allow_special_tokens_in_content` restores the pass-through for trusted callers.
"""

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvpager.engine.frontend import chat_fallbacks
from kvpager.engine.structured.compile_pool import CompilePool
from kvpager.engine.structured.compile_thread import CompileThread
from kvpager.engine.structured.grammar import GrammarCompiler
from kvpager.engine.structured.limits import DEFAULT_LIMITS, GrammarLimits, check_spec
from kvpager.schemas.errors import InvalidRequestError
from kvpager.schemas.public_requests import PromptCache
from kvpager.schemas.sampling import SamplingParams
from transformers import PreTrainedTokenizerBase

# The caller's check of a prompt's token ids (and the field that gave them), run after they are
# known and before the grammar compiles: cheap caps refuse a request before costly work.
PromptCheck = Callable[[list[int], str], None]
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


@dataclass(frozen=True)
class ProcessedPrompt:
    """A request's prompt, ready for a scheduler."""

    token_ids: list[int]
    param: str  # the field that gave it
    text: str | None = None  # with `echo`: the text prompt as given, else its ids decoded
    num_pinned_tokens: int = 0  # `cache`: the prompt's first tokens to pin (full blocks only)


class InputProcessor:
    """Token ids for a prompt, a conversation or given ids, checked against the vocabulary.

    Structured-outputs specs are checked against `grammar_limits` first, then compiled: by a
    server (`compile_workers`) in worker processes, so that a grammar that crashes llguidance
    costs a worker; offline, in a large-stack thread of the caller's process."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        allow_special_tokens_in_content: bool = False,
        grammar_limits: GrammarLimits = DEFAULT_LIMITS,
        compile_workers: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        allow = allow_special_tokens_in_content
        self._special_text = None if allow else special_token_pattern(tokenizer)
        self.grammar_limits = grammar_limits
        self.compile_workers = compile_workers
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._thread = CompileThread(grammar_limits.compile_timeout)
        self._pool: CompilePool | None = None
        self._renders_tools: bool | None = None  # known on the first request with tools

    async def process(
        self,
        params: SamplingParams,
        *,
        prompt: str | Sequence[int] | None = None,
        messages: list[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        tools: list[dict] | None = None,
        check: PromptCheck | None = None,
        echo: bool = False,
        cache: PromptCache | None = None,
    ) -> ProcessedPrompt:
        """One request's prompt, given by exactly one of `prompt` (a text, or token ids
        offline), `messages` (with `tools`, for the template) or `prompt_token_ids`: the
        structured-outputs spec's sizes (cheap), the token ids, `check(token_ids, param)`,
        then the spec compiled. Every refusal is a typed error naming the field. `cache`
        (GenerateRequest.cache) is resolved to the number of prompt tokens to pin."""
        spec = params.structured_outputs
        if spec is not None:
            check_spec(spec, self.grammar_limits)
        self._check_logit_bias(params)
        given = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids}
        param = _prompt_field(given, tools)
        if param == "messages":  # a constrained answer needs no tool list in the prompt
            shown = spec is None
            token_ids = self.chat_ids(messages, tools=tools, tools_in_system=shown)
        else:
            token_ids = self.prompt_ids(given[param], param)
        if check is not None:
            check(token_ids, param)
        num_pinned = self.pinned_prefix(cache, token_ids, messages, tools)
        await self._compile(params)
        text = None
        if echo:
            text = prompt if isinstance(prompt, str) else self._decode(token_ids)
        return ProcessedPrompt(token_ids, param, text, num_pinned)

    def pinned_prefix(
        self,
        cache: PromptCache | None,
        token_ids: list[int],
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> int:
        """The prompt tokens `cache` pins: `prefix_tokens` as given, the first
        `prefix_messages` messages as the template renders them (no generation prompt: the
        tokens they share with the whole prompt), else the whole prompt. The engine pins the
        full blocks among them."""
        if cache is None:
            return 0
        if cache.prefix_tokens is not None and cache.prefix_messages is not None:
            raise InvalidRequestError(
                "cache: give at most one of prefix_tokens and prefix_messages", "cache"
            )
        if cache.prefix_tokens is not None:
            if cache.prefix_tokens > len(token_ids):
                raise InvalidRequestError(
                    f"cache.prefix_tokens: {cache.prefix_tokens} exceeds the prompt's "
                    f"{len(token_ids)} tokens",
                    "cache",
                )
            return cache.prefix_tokens
        if cache.prefix_messages is None:
            return len(token_ids)
        if messages is None:
            raise InvalidRequestError("cache.prefix_messages: only with messages", "cache")
        if cache.prefix_messages > len(messages):
            raise InvalidRequestError(
                f"cache.prefix_messages: {cache.prefix_messages} exceeds the "
                f"{len(messages)} messages",
                "cache",
            )
        head = messages[: cache.prefix_messages]
        head_ids = self.chat_ids(head, add_generation_prompt=False, tools=tools)
        return _common_prefix(head_ids, token_ids)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        outside = sorted(t for t in (params.logit_bias or {}) if not 0 <= t < vocab)
        if outside:
            message = f"logit_bias: token ids must be in [0, {vocab}), got {outside[:5]}"
            raise InvalidRequestError(message, param="logit_bias")

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def _compile(self, params: SamplingParams) -> None:
        """A structured-outputs spec that cannot be compiled is refused, naming the field,
        before the request reaches a scheduler (the executor compiles it again, from its own
        cache): by a server in a worker process, awaited; offline in a large-stack thread,
        blocking (nothing else runs on the offline door's loop meanwhile)."""
        spec = params.structured_outputs
        if spec is None:
            return
        if self.compile_workers:
            await self.pool.check_async(spec)
            return
        if self._grammars is None:
            self._grammars = GrammarCompiler.from_hf(self.tokenizer, self.vocab_size)
        grammars = self._grammars
        self._thread.run(lambda: grammars.check(spec), f"structured_outputs.{spec.kind}")

    @property
    def pool(self) -> CompilePool:
        """The compile workers, started on the first structured request."""
        if self._pool is None:
            tokenizer_json = self.tokenizer.backend_tokenizer.to_str()
            eos = self.tokenizer.eos_token_id or 0
            self._pool = CompilePool(self.grammar_limits, tokenizer_json, self.vocab_size, eos)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

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
        tools: list[dict] | None = None,
        tools_in_system: bool = True,
    ) -> list[int]:
        """A conversation rendered with the model's chat template, by default ready for a
        reply; the template writes its own special tokens, `add_special_tokens` adds the
        tokenizer's on top (vLLM's /tokenize option). `tools` (OpenAI's definitions) go to
        the template, as transformers' `apply_chat_template(tools=...)` takes them; a template
        that ignores them gets them in the system turn (engine/frontend/chat_fallbacks.py)
        unless `tools_in_system` is false, as it gets developer turns as system ones."""
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("messages: this model has no chat template", "messages")
        if self._special_text is not None:
            _refuse_special_text(self._special_text, messages, "messages")
            _refuse_special_text(self._special_text, tools, "tools")
        template = chat_fallbacks.template_text(self.tokenizer)
        messages = chat_fallbacks.with_system_roles(messages, template)
        if tools and tools_in_system and not self.renders_tools:
            messages, tools = chat_fallbacks.with_tools_in_system(messages, tools), None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template may raise on roles it does not know
            raise InvalidRequestError(f"messages: {exc}", param="messages") from exc
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.checked(token_ids, "messages")

    @property
    def renders_tools(self) -> bool:
        """The chat template writes `tools` into the prompt (probed once)."""
        if self._renders_tools is None:
            self._renders_tools = chat_fallbacks.renders_tools(self.tokenizer)
        return self._renders_tools

    def checked(self, token_ids: list[int], param: str) -> list[int]:
        """Non-empty, every id in the vocabulary."""
        if not token_ids:
            raise InvalidRequestError(f"{param}: must not be empty", param=param)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab})", param)
        return token_ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    num = 0
    for x, y in zip(a, b):
        if x != y:
            break
        num += 1
    return num


def _prompt_field(given: dict[str, object], tools: list[dict] | None) -> str:
    """The one field that gives the prompt; tools go with messages only."""
    named = [name for name in PROMPT_FIELDS if given[name] is not None]
    if len(named) != 1:
        raise InvalidRequestError(
            f"exactly one of prompt, messages or prompt_token_ids is required, got {len(named)}",
            param=named[-1] if named else "prompt",
        )
    if tools is not None and named[0] != "messages":
        raise InvalidRequestError("tools: only with messages", param="tools")
    return named[0]


def special_token_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern | None:
    """Every special token's text, which encode() turns into its id wherever it appears;
    longest first, so one that contains another is named whole."""
    texts = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    texts = {text for text in texts | set(tokenizer.all_special_tokens) if text}
    if not texts:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True)))


def _refuse_special_text(pattern: re.Pattern, value, param: str) -> None:
    for path, text in _strings(value, param):
        found = pattern.search(text)
        if found is not None:
            raise InvalidRequestError(
                f"{path}: contains the special token {found.group()!r} as text, which would "
                "become a real control token (e.g. a turn marker); remove it, or start kvpager "
                "with --allow-special-tokens-in-content",
                param=path,
            )


def _strings(value, path: str) -> Iterator[tuple[str, str]]:
    """Every string in a message / tool definition (keys too), with where it is."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, path)
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for idx, item in enumerate(value):
            yield from _strings(item, f"{path}[{idx}]")
