"""Token texts for logprobs and echo, as the tokenizer service wrote them into the events
(each logprob entry's token and alternatives, an echoed prompt's tokens): the gateway holds no
tokenizer. An id no event named (a tokenizer service older than those fields) is written
`token_id:<id>`, as vLLM's `--return-tokens-as-token-ids` does."""

from kvpager.schemas.public import GenerateEvent, PromptLogprob, TokenLogprob


class TokenTexts:
    """The texts one response's events gave, by token id (an id's text never changes)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    def learn(self, event: GenerateEvent) -> None:
        if event.prompt_token_ids is not None and event.prompt_tokens is not None:
            self._texts.update(zip(event.prompt_token_ids, event.prompt_tokens))
        for lp in (event.logprobs or []) + (event.prompt_logprobs or []):
            if lp is not None:
                self._learn_entry(lp)

    def _learn_entry(self, lp: TokenLogprob | PromptLogprob) -> None:
        if lp.token is not None:
            self._texts[lp.token_id] = lp.token
        if lp.top_tokens is not None:
            self._texts.update(zip(lp.top_token_ids, lp.top_tokens))

    def text(self, token_id: int) -> str:
        return self._texts.get(token_id, f"token_id:{token_id}")


def text_offsets(tokens: list[str], offset: int) -> tuple[list[int], int]:
    """Each token's `text_offset` in completions' logprobs (from `offset` on), and the offset
    after the last."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return offsets, offset
