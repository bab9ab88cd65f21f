"""A step's output into the scheduler: sampled tokens appended (speculation's accepted runs
rolled back to what was accepted), stops and lengths finished, beam selections applied, and
failures that end their own request alone.

Mixed into Scheduler (engine/sched/scheduler.py), whose requests it updates.
"""

from collections import deque

import structlog
from kvpager.engine.kv.block_manager import BlockManager
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.request import Request, RequestStatus
from kvpager.engine.sched.beam_scheduler import BeamScheduler
from kvpager.engine.sched.lookahead import Lookahead
from kvpager.schemas.executor import ScheduledStep
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import StepOutput

log = structlog.get_logger(__name__)


class OutputUpdate:
    """The scheduler's update side: `update_from_output` is what the engine core calls."""

    block_manager: BlockManager | HybridBlockManager
    waiting: deque[Request]
    seqs: dict[str, Request]
    groups: dict[str, list[Request]]
    beams: BeamScheduler
    lookahead: Lookahead
    failed: dict[str, ErrorInfo]
    _sampling: dict[int, list[Request]]

    def update_from_output(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Append sampled tokens and finish requests that stop (computed counts moved already).

        Returns the requests that got a new token this step (finished ones included). A token
        for a request preempted since the step was planned is kept: it was computed from the
        right context. One for a finished request is dropped.
        """
        assert output.step_id == step.step_id, f"step {output.step_id} != {step.step_id}"
        self.waiting.extendleft(reversed(self.block_manager.disk.apply(output)))
        emitted = {seq_id: output.emitted_token_ids(i) for i, seq_id in enumerate(output.seq_ids)}
        for abandoned in [s for s in self._sampling if s < step.step_id]:
            del self._sampling[abandoned]  # outputs come in order: theirs never will
        self._fail_rows(output.failed)
        updated = []
        for request in self._sampling.pop(step.step_id, []):
            try:
                updated += self._update_one(request, output, emitted)
            except Exception as exc:  # one request's failure ends that request alone
                self.fail(request.request_id, exc)
        self.lookahead.end_step(step.step_id)
        return [request for request in updated if request.request_id not in self.failed]

    def _update_one(self, request: Request, output: StepOutput, emitted: dict[str, list[int]]):
        if self._is_beam(request):
            if request.status is RequestStatus.RUNNING:
                self._report_beam(request, output.beam_candidates.get(request.seq_id))
            return []
        request.num_output_placeholders -= 1
        if request.is_finished:
            return []
        return self._append_sampled(request, output, emitted)

    def fail(self, request_id: str, exc: Exception) -> None:
        """End every sample of a request whose output, parameters or beams raised: its blocks
        are freed, and `take_failed()` hands its error to the engine core."""
        log.exception("request failed", request_id=request_id)
        self.abort(request_id)
        message = f"the request failed while its output was processed: {exc!r}"
        self.failed[request_id] = ErrorInfo(getattr(exc, "type", "internal_error"), message)

    def _fail_rows(self, failed: dict[str, str]) -> None:
        """Samples the executor could not constrain to their grammar: each request ends alone
        with a typed error (never unconstrained)."""
        for seq_id, message in failed.items():
            request = self.seqs.get(seq_id)
            if request is not None and request.request_id not in self.failed:
                self.abort(request.request_id)
                self.failed[request.request_id] = ErrorInfo("invalid_request", message)

    def take_failed(self) -> dict[str, ErrorInfo]:
        """Requests failed since the last call: request id -> its error."""
        failed, self.failed = self.failed, {}
        return failed

    def _report_beam(self, beam: Request, candidates: list[tuple[int, float]] | None) -> None:
        """Apply a beam group's selection once all its live beams have reported."""
        selection = self.beams.report(beam, candidates, self.groups[beam.request_id])
        if selection is None:
            return
        for source, child in selection.forks:
            self.add_forked(source, child)
        for ended in selection.ended:
            self.finish(ended, RequestStatus.FINISHED_STOPPED)

    def _append_sampled(self, request: Request, output: StepOutput, emitted) -> list[Request]:
        """Append the step's tokens one by one: a stop or max_tokens in the middle of an
        accepted run finishes the request there and drops the tokens after it."""
        token_ids = emitted.get(request.seq_id)
        assert token_ids, f"step output lacks {request.seq_id}'s token"
        self.lookahead.roll_back(output.step_id, request, len(token_ids), self.block_manager)
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            status = request.check_stop()
            if status is not None:
                self.finish(request, status)
                return [request]
        self.lookahead.take_drafts(request, output.draft_token_ids.get(request.seq_id))
        return [request]
