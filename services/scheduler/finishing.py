"""Ending requests before they stop on their own: stop strings, aborts, failures. No NATS here.

Each frees the request's blocks in the engine Scheduler at once and puts a final SampleDelta
per ended sample in the outbox, so a stream's final event always follows the freeing.
"""

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from schemas.public import ErrorInfo
from schemas.scheduler import FinishRequest
from services.scheduler.outbox import Outbox


def finish_early(core: Scheduler, outbox: Outbox, finish: FinishRequest) -> bool:
    """Abort every sample, or stop the one a stop string ended; False for an unknown id.

    Unknown ids are expected: the request has finished and its last delta is on its way.
    """
    group = list(core.groups.get(finish.request_id, ()))
    if finish.finish_reason == "stop":
        for request in group:
            if request.sample_index == finish.index and not request.is_finished:
                request.stop_reason = finish.stop_reason
                core.finish(request, RequestStatus.FINISHED_STOPPED)
                _final(outbox, request.group_id, request.sample_index, "stop", request)
    elif group:
        core.abort(finish.request_id)
        route = outbox.routes.get(finish.request_id)
        for index in sorted(route.open_indices) if route else ():
            _final(outbox, finish.request_id, index, "abort", group[0])  # unforked samples too
    return bool(group)


def fail_all(core: Scheduler, outbox: Outbox, error: ErrorInfo) -> None:
    """Every request with a stream ends with `error`; its blocks are freed."""
    for request_id in list(outbox.routes):
        for request in list(core.groups.get(request_id, ())):
            core.finish(request, RequestStatus.FINISHED_ABORTED)
    fail_routes(outbox, error)


def fail_routes(outbox: Outbox, error: ErrorInfo) -> None:
    """Final error deltas for every open stream, without touching the engine (it may be broken)."""
    for request_id, route in list(outbox.routes.items()):
        for index in sorted(route.open_indices):
            outbox.add_final(request_id, index, "error", error)


def _final(outbox: Outbox, request_id: str, index: int, reason: str, request: Request) -> None:
    outbox.add_final(request_id, index, reason, num_cached_tokens=request.num_cached_tokens)
