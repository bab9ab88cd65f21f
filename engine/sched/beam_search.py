"""Beam search over paged sequences, with Hugging Face `generate(num_beams=k)` semantics.

Each live beam is a Request; beams of one group advance in lockstep. When every live beam has
reported its top candidates (token id, log-prob) for the next position, `select` ranks all
continuations by cumulative log-prob (float32, as transformers accumulates), moves the best
ones that end a sequence (EOS, stop token or max_tokens) into the finished set with the length
penalty applied, and keeps the best `beam_width` others running. The scheduler turns the
selection into block operations: a beam chosen twice forks (sharing blocks, copy-on-write),
a beam not chosen is freed.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from kvpager.engine.request import Request
from kvpager.schemas.sampling import SamplingParams


@dataclass
class Continuation:
    source: Request
    token_id: int
    score: np.float32  # cumulative log-prob of the sequence including this token


@dataclass
class FinishedBeam:
    score: np.float32  # length-penalised
    token_ids: list[int]
    finish_reason: str = "length"  # "stop" when it ended on an EOS or stop token


@dataclass
class BeamSearchGroup:
    params: SamplingParams
    stop_token_ids: frozenset[int]
    scores: dict[str, np.float32] = field(default_factory=dict)  # live beam id -> cum. log-prob
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[FinishedBeam] = field(default_factory=list)  # best first, at most k
    improvement_possible: bool = True

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step, as transformers does: enough to survive stop tokens."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def start(self, root: Request) -> None:
        self.scores[root.seq_id] = np.float32(0.0)

    def report(self, beam: Request, candidates: list[tuple[int, float]]) -> bool:
        """Store one beam's candidates; True once every live beam has reported."""
        self.candidates[beam.seq_id] = candidates
        return len(self.candidates) == len(self.scores)

    def select(self, beams: list[Request]) -> tuple[list[Continuation], bool]:
        """The next running beams (best first) and whether the search is done."""
        num_generated = beams[0].num_output_tokens + 1
        ranked = self._rank(beams)[: self.num_candidates]
        ends = [
            c.token_id in self.stop_token_ids or num_generated >= self.params.max_tokens
            for c in ranked
        ]
        self._update_finished(ranked[: self.width], ends[: self.width], num_generated)
        running = [c for c, end in zip(ranked, ends) if not end][: self.width]
        self.candidates, self.scores = {}, {}  # the scheduler records the new beams' scores
        done = all(ends) or not running or self._should_stop(running[0], num_generated)
        return running, done

    def _rank(self, beams: list[Request]) -> list[Continuation]:
        pool = []
        for beam in beams:
            base = self.scores[beam.seq_id]
            for token_id, logprob in self.candidates[beam.seq_id]:
                pool.append(Continuation(beam, token_id, np.float32(base + np.float32(logprob))))
        pool.sort(key=lambda c: -c.score)  # stable: ties keep beam order, then token rank
        return pool

    def _update_finished(self, top: list[Continuation], ends: list[bool], length: int) -> None:
        full = len(self.finished) == self.width
        if (full and self.params.early_stopping) or not self.improvement_possible:
            return
        penalty = np.float32(length**self.params.length_penalty)
        new = [
            FinishedBeam(
                np.float32(c.score / penalty),
                c.source.output_token_ids + [c.token_id],
                "stop" if c.token_id in self.stop_token_ids else "length",
            )
            for c, end in zip(top, ends)
            if end
        ]
        merged = self.finished + new
        merged.sort(key=lambda f: -f.score)
        self.finished = merged[: self.width]

    def _should_stop(self, best_running: Continuation, length: int) -> bool:
        if len(self.finished) == self.width:
            worst = min(f.score for f in self.finished)
            best = np.float32(best_running.score / np.float32(length**self.params.length_penalty))
            self.improvement_possible = self.improvement_possible and bool(best > worst)
            if self.params.early_stopping:
                return True
        return not self.improvement_possible


def num_candidates(params: SamplingParams, eos_ids: Iterable[int]) -> int:
    """Candidates one beam row needs: the selection keeps the group's `width` best
    continuations and ends those on a stop token, so a beam contributes at most `width` of its
    own best tokens plus the stop tokens ranked among them. (The group's pool of
    (1 + stops) x width, as transformers keeps it, then never runs short: it holds at most
    stops x width ends.) Bounded at admission (the tokenizer service's limits)."""
    return params.beam_width + len(set(eos_ids) | set(params.stop_token_ids))
