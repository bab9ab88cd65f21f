"""Beam search for the scheduler: turn each selection into forks, ends and new tokens.

The scheduler reports each beam's candidates here; once a group's live beams have all
reported, the selection comes back for the scheduler to apply with its generic operations: a
beam chosen twice forks (the child shares its blocks), a beam not chosen ends and frees its
blocks. Every new beam's token is queued for the executor, which does not sample beams itself.
"""

from dataclasses import dataclass, field

from kvpager.engine.request import Request
from kvpager.engine.sched.beam_search import BeamSearchGroup, Continuation, FinishedBeam
from kvpager.schemas.executor import ForkRequest


@dataclass
class BeamSelection:
    """What the scheduler does after a group's step: fork (source, child), end these beams."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)


class BeamScheduler:
    def __init__(self) -> None:
        self.groups: dict[str, BeamSearchGroup] = {}
        self.results: dict[str, list[FinishedBeam]] = {}  # finished searches, to collect
        self.forks: list[ForkRequest] = []  # row copies for the next step
        self.tokens: dict[str, int] = {}  # chosen tokens the executor has not seen yet
        self._num_children = 0

    def start(self, root: Request) -> None:
        params = root.sampling_params
        group = BeamSearchGroup(params, frozenset(root.eos_token_ids) | set(params.stop_token_ids))
        group.start(root)
        self.groups[root.request_id] = group

    def report(
        self, beam: Request, candidates: list[tuple[int, float]] | None, members: list[Request]
    ) -> BeamSelection | None:
        """One beam's candidates; the group's selection once every live beam has reported."""
        if candidates is None:
            return None  # a prefill chunk that has not reached the end of the prompt
        group = self.groups[beam.request_id]
        if not group.report(beam, candidates):
            return None
        return self._advance(group, [r for r in members if r.seq_id in group.scores])

    def _advance(self, group: BeamSearchGroup, beams: list[Request]) -> BeamSelection:
        running, done = group.select(beams)
        beams[0].num_pending_forks = 0  # the root's reserved seats are now beams
        if done:
            self.results[beams[0].request_id] = group.finished
            return BeamSelection(ended=beams)
        selection = BeamSelection()
        assigned = self._assign(running, selection)
        for beam, cont in assigned:
            beam.output_token_ids.append(cont.token_id)
            self.tokens[beam.seq_id] = cont.token_id
            group.scores[beam.seq_id] = cont.score
        chosen = {cont.source.seq_id for _, cont in assigned}
        selection.ended = [beam for beam in beams if beam.seq_id not in chosen]
        return selection

    def _assign(
        self, running: list[Continuation], selection: BeamSelection
    ) -> list[tuple[Request, Continuation]]:
        """A beam per continuation: its source the first time, a fork of it after that.

        Forks copy their source before any new token is appended.
        """
        seen: set[str] = set()
        assigned = []
        for cont in running:
            source = cont.source
            if source.seq_id in seen:
                self._num_children += 1
                child = source.fork(f"{source.request_id}~{self._num_children}")
                selection.forks.append((source, child))
                self.forks.append(ForkRequest(source.seq_id, child.seq_id, sample=False))
                assigned.append((child, cont))
            else:
                seen.add(source.seq_id)
                assigned.append((source, cont))
        return assigned

    def pop_token(self, request_id: str) -> list[int]:
        token_id = self.tokens.pop(request_id, None)
        return [] if token_id is None else [token_id]

    def take_forks(self) -> list[ForkRequest]:
        forks, self.forks = self.forks, []
        return forks

    def take_results(self) -> dict[str, list[FinishedBeam]]:
        results, self.results = self.results, {}
        return results
