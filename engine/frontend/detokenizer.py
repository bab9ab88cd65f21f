"""Incremental detokenizer: token ids in, finished text out, with stop strings.

Decoding re-decodes only a small window of ids each token (vLLM's prefix/read offsets):

    ids:  [ last prompt ids ... | output ids ......................... | new id ]
                  prefix_offset ^               read_offset ^
    prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
    window_text = decode(ids[prefix_offset:])

The delta is `window_text[len(prefix_text):]`. Decoding with context matters: tokenizers
that strip a word's leading space at the start of a decode (SentencePiece's "▁") would lose
it if a token were decoded alone. A window ending in U+FFFD may be a multi-byte character
cut between tokens, so nothing is emitted and the window grows until the character is whole.
"""

from kvpager.schemas.sampling import SamplingParams
from transformers import PreTrainedTokenizerBase

# Prompt ids decoded as context for the first output token (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _WindowDecoder:
    """Turns ids into text that will not change, decoding O(window) ids per token."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special: bool
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window_text[len(prefix_text) :]

    def finish(self) -> str:
        """Text held back at the end: an incomplete character becomes U+FFFD, as in decode()."""
        prefix_text, window_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        num_prefix = self._read_offset - self._prefix_offset
        return self._decode(window[:num_prefix]), self._decode(window)

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str), "decode of one sequence returns one string"
        return text


class _StopStringFilter:
    """Cuts text at the first stop string and holds back what a later stop could still cut."""

    def __init__(self, stops: list[str], include_stop: bool):
        self._stops = stops
        self._include_stop = include_stop
        # Emitted text a new match could still start in: only with include_stop, since without
        # it every possible match start is held back, never emitted.
        longest_stop = max((len(s) for s in stops), default=0)
        self._tail_len = longest_stop - 1 if include_stop and longest_stop else 0
        self._emitted_tail = ""
        self._held = ""
        self.stopped: str | None = None

    @property
    def held(self) -> str:
        return self._held

    def add(self, text: str, final: bool) -> str:
        """Returns the text now safe to show; `final` releases everything not cut."""
        assert self.stopped is None, "text added after a stop string matched"
        window = self._emitted_tail + self._held + text
        num_emitted = len(self._emitted_tail)
        cut = self._first_stop_cut(window)
        if cut is not None:
            assert cut >= num_emitted, "a stop string cut text already emitted"
            self._held = ""
            return window[num_emitted:cut]
        num_hold = 0 if final else min(self._partial_stop_len(window), len(window) - num_emitted)
        safe_end = len(window) - num_hold
        self._held = window[safe_end:]
        self._emitted_tail = window[:safe_end][-self._tail_len :] if self._tail_len else ""
        return window[num_emitted:safe_end]

    def _first_stop_cut(self, window: str) -> int | None:
        """Where the text ends if a stop string matches: the earliest match wins."""
        matches = [(idx, stop) for stop in self._stops if (idx := window.find(stop)) >= 0]
        if not matches:
            return None
        idx, stop = min(matches, key=lambda match: match[0])
        self.stopped = stop
        return idx + len(stop) if self._include_stop else idx

    def _partial_stop_len(self, window: str) -> int:
        """Length of the longest end of `window` that some stop string starts with."""
        if self._include_stop:
            return 0  # a later match ends in later text, so it never cuts what is shown now
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class IncrementalDetokenizer:
    """Streams one request's output text, token by token, honouring stop strings.

    `add_tokens` returns the newly final text; text that a stop string could still cut
    (the longest end of the text that begins a stop string) is held back until it is safe,
    and `flush()` releases it when the request finishes. After a stop string matches,
    `stopped` names it and the text is cut there (keeping it if include_stop_str_in_output).
    Decoding skips special tokens if the params say so and never cleans up spaces, so the
    streamed text equals `tokenizer.decode(output_ids, ..., clean_up_tokenization_spaces=False)`
    (up to stop strings; with a prompt, a first word keeps the space the prompt implies).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ):
        self._decoder = _WindowDecoder(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stop_filter = _StopStringFilter(params.stop, params.include_stop_str_in_output)
        self._emitted: list[str] = []

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop_filter.stopped

    @property
    def text(self) -> str:
        """All output text so far, including text held back from streaming."""
        return "".join(self._emitted) + self._stop_filter.held

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Decode newly sampled ids; returns the text a client may now be shown."""
        assert self.stopped is None, "tokens added after a stop string matched"
        new_text = "".join(self._decoder.add(token_id) for token_id in new_token_ids)
        return self._emit(self._stop_filter.add(new_text, final=False))

    def flush(self) -> str:
        """At finish: everything still held back (an incomplete last character as U+FFFD)."""
        if self.stopped is not None:
            return ""
        return self._emit(self._stop_filter.add(self._decoder.finish(), final=True))

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text
