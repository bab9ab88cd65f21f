"""Token texts for logprobs. The gateway holds no model, only, when the model folder is on this
machine, its tokenizer (loaded on the first request that asks for logprobs). Without it a
token is written `token_id:<id>`, as vLLM's `--return-tokens-as-token-ids` does."""

import asyncio
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class TokenTexts:
    def __init__(self, model: str) -> None:
        self._path = Path(model).expanduser()
        self._available = self._path.is_dir()  # False also once loading failed
        self._tokenizer: Any = None
        self._loading: asyncio.Task | None = None

    async def load(self) -> None:
        """Load the tokenizer once, off the event loop; later calls return at once."""
        if self._tokenizer is not None or not self._available:
            return
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(asyncio.to_thread(self._read))
        await asyncio.shield(self._loading)

    def _read(self) -> None:
        from transformers import AutoTokenizer  # slow to import: only when logprobs are asked

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self._path))
        except Exception as exc:  # no tokenizer files: token ids it is
            log.warning("no tokenizer for logprobs", path=str(self._path), error=repr(exc))
            self._available = False

    def text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def text_offsets(tokens: list[str], offset: int) -> tuple[list[int], int]:
    """Each token's `text_offset` in completions' logprobs (from `offset` on), and the offset
    after the last."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return offsets, offset
