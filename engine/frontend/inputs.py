"""The input path shared by both front doors: prompts in, checked token ids out.

`InputProcessor` tokenizes a prompt, applies the chat template to messages, and checks the
token ids against the vocabulary; the offline `LLM` and the tokenizer service both call it.
A server's own caps on requests live with it (services/tokenizer/limits.py).
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from engine.structured.grammar import GrammarCompiler
from schemas.errors import InvalidRequestError
from schemas.sampling import SamplingParams


class InputProcessor:
    """Token ids for a prompt, a conversation or given ids, checked against the vocabulary."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    def check_structured(self, params: SamplingParams) -> None:
        """A structured-outputs spec that cannot be compiled is refused here, naming the
        field, before the request reaches a scheduler (the executor compiles it again, from
        its own cache)."""
        if params.structured_outputs is None:
            return
        if self._grammars is None:
            self._grammars = GrammarCompiler.from_hf(self.tokenizer, self.vocab_size)
        self._grammars.check(params.structured_outputs)

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
    ) -> list[int]:
        """A conversation rendered with the model's chat template, by default ready for a
        reply; the template writes its own special tokens, `add_special_tokens` adds the
        tokenizer's on top (vLLM's /tokenize option). `tools` (OpenAI's definitions) go to
        the template, as transformers' `apply_chat_template(tools=...)` takes them."""
        if not self.tokenizer.chat_template:
            raise InvalidRequestError("messages: this model has no chat template", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template may raise on roles it does not know
            raise InvalidRequestError(f"messages: {exc}", param="messages") from exc
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.checked(token_ids, "messages")

    def checked(self, token_ids: list[int], param: str) -> list[int]:
        """Non-empty, every id in the vocabulary."""
        if not token_ids:
            raise InvalidRequestError(f"{param}: must not be empty", param=param)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab})", param)
        return token_ids
