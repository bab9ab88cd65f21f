"""The executor's grammar matchers: one per structured sequence, beside its row.

Where the matchers live (docs/user/structured-outputs.md says why): vLLM keeps
them in its scheduler's process and ships packed bitmasks to the workers. Here the scheduler
holds no tokenizer (its container has no model folder), and it plans a step ahead of the
executor, so a mask made there for step N+1 would wait for step N's token: structured
requests would have to run lockstep. A mask is 6 KB a sequence a step at 49,152 tokens (1.5
MB for 256 sequences, past NATS's default 1 MB message). The executor appends every sampled token
itself, so its matchers are always up to date: it fills each structured row's mask just before
sampling (a vectorised unpack, small beside a step) and advances the matcher by the tokens the row
emitted. Only the spec's strings cross NATS, once, in the request's SamplingParams.

A row whose grammar cannot be compiled (in a large-stack thread, with a time budget) or
whose matcher errs mid-generation is reported in the step's output (`failed`): the scheduler
ends that request alone with a typed error, and the token sampled for it is dropped. It
never goes on unconstrained.
"""

from pathlib import Path

import llguidance
import torch
from kvpager.engine.structured.compile_thread import CompileThread
from kvpager.engine.structured.grammar import GrammarCompiler, fill_bitmask
from kvpager.engine.structured.limits import DEFAULT_LIMITS
from kvpager.engine.worker.input_batch import RequestState
from kvpager.schemas.errors import ConfigError, InvalidRequestError


class GrammarRows:
    """Matchers by seq id; the compiler (and its tokenizer view) is built on first use."""

    def __init__(
        self,
        model_path: Path | str,  # the folder of its tokenizer.json: the model's, or --tokenizer
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        compile_timeout: float = DEFAULT_LIMITS.compile_timeout,
    ) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.failed: dict[str, str] = {}  # seq id -> why, until the next step's output
        self._compiler: GrammarCompiler | None = None
        self._thread = CompileThread(compile_timeout)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            path = self.model_path / "tokenizer.json"
            if not path.is_file():
                raise ConfigError(f"structured outputs need {path}")
            self._compiler = GrammarCompiler.from_tokenizer_json(
                path.read_text(), self.vocab_size, self.eos_token_id
            )
        return self._compiler

    def add(self, state: RequestState) -> None:
        """A row new to the executor; resumed after recompute, its outputs so far are replayed."""
        spec = state.params.structured_outputs
        if spec is None:
            return
        param = f"structured_outputs.{spec.kind}"
        try:
            matcher = self._thread.run(lambda: self.compiler.matcher(spec), param)
        except InvalidRequestError as exc:
            self.failed[state.seq_id] = str(exc)
            return
        matcher.consume_tokens(state.output_token_ids)
        self.matchers[state.seq_id] = matcher
        self._check(state.seq_id, matcher)

    def fork(self, parent_id: str, child_id: str) -> None:
        """A parallel sample or beam copy: the parent's matcher as it stands."""
        parent = self.matchers.get(parent_id)
        if parent is not None:
            self.matchers[child_id] = parent.deep_copy()

    def remove(self, seq_id: str) -> None:
        self.matchers.pop(seq_id, None)
        self.failed.pop(seq_id, None)

    def clear(self) -> None:
        self.matchers.clear()
        self.failed.clear()

    def take_failed(self) -> dict[str, str]:
        """Rows failed since the last call: seq id -> the typed error's message."""
        failed, self.failed = self.failed, {}
        return failed

    def bitmask(
        self, states: list[RequestState], offsets: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows int64 [m], bitmask int32 [m, words]) for the structured states' sampling
        rows (`offsets[i]`: state i's row), or None when no state is structured."""
        picked = [(offsets[i], s.seq_id) for i, s in enumerate(states) if s.seq_id in self.matchers]
        if not picked:
            return None
        num_words = self.compiler.num_words
        packed = b"".join(self._mask(seq_id, num_words) for _, seq_id in picked)
        bitmask = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(picked), -1)
        rows = torch.tensor([row for row, _ in picked], dtype=torch.int64, device=device)
        return rows, bitmask

    def _mask(self, seq_id: str, num_words: int) -> bytes:
        """The row's mask; a matcher in error fails its row, whose token is then dropped (the
        mask allows only EOS, so that the sampler still has a token to draw)."""
        mask = fill_bitmask(self.matchers[seq_id], num_words)
        if mask is not None:
            return mask
        self._check(seq_id, self.matchers[seq_id])
        words = bytearray(4 * num_words)
        words[self.eos_token_id // 8] |= 1 << (self.eos_token_id % 8)
        return bytes(words)

    def _check(self, seq_id: str, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error() and seq_id not in self.failed:
            error = matcher.get_error()
            self.failed[seq_id] = f"structured_outputs: the grammar failed mid-generation: {error}"

    def accept(self, state: RequestState, token_ids: list[int]) -> None:
        """The tokens a row emitted this step. A complete grammar keeps allowing EOS only, so
        a request that goes on (ignore_eos, or the step planned ahead of its stop) stays
        constrained."""
        matcher = self.matchers.get(state.seq_id)
        if matcher is not None and not matcher.is_stopped():
            matcher.consume_tokens(token_ids)
            self._check(state.seq_id, matcher)
