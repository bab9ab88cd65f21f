"""Where sampled tokens go: each request's tokenizer replica, one TokenBatch per step."""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from engine.beam_search import FinishedBeam
from engine.request import Request
from schemas.public import ErrorInfo
from schemas.scheduler import TokenLogprobs
from schemas.tokenizer import SampleDelta, TokenBatch
from services.wire import pack


@dataclass
class Route:
    """A request's way back to its tokenizer, and its timings."""

    reply_to: str
    open_indices: set[int]  # samples that have not had their final delta
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    scheduled_at: float | None = None  # first scheduled


def _ignore(route: Route) -> None:
    pass


class Outbox:
    """Deltas collected per tokenizer subject, published together, in order."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.routes: dict[str, Route] = {}  # by request (group) id
        self._deltas: dict[str, list[SampleDelta]] = {}
        self._lock = asyncio.Lock()
        self.on_done: Callable[[Route], None] = _ignore  # a route's every sample has ended

    def add_token(self, request: Request, logprobs: TokenLogprobs | None) -> Route | None:
        """The request's newest token; a final delta too if it has finished."""
        route = self.routes.get(request.group_id)
        if route is None:
            return None
        delta = SampleDelta(
            request.group_id,
            request.sample_index,
            request.output_token_ids[-1:],
            logprobs=None if logprobs is None else [logprobs],
        )
        if request.is_finished:
            delta.finish_reason = request.status.value
            delta.stop_reason = request.stop_reason
            delta.num_cached_tokens = request.num_cached_tokens
        self._push(route, delta)
        return route

    def add_beams(self, request_id: str, beams: list[FinishedBeam], num_cached_tokens: int) -> None:
        """A beam search's result, whole: the best `n` beams as final deltas, best first."""
        route = self.routes.get(request_id)
        if route is None:
            return
        for index, beam in zip(sorted(route.open_indices), beams):
            delta = SampleDelta(
                request_id,
                index,
                beam.token_ids,
                finish_reason=beam.finish_reason,
                num_cached_tokens=num_cached_tokens,
                cumulative_score=float(beam.score),
            )
            self._push(route, delta)

    def add_final(
        self,
        request_id: str,
        index: int,
        finish_reason: str,
        error: ErrorInfo | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        route = self.routes.get(request_id)
        if route is not None and index in route.open_indices:
            self._push(
                route,
                SampleDelta(
                    request_id,
                    index,
                    finish_reason=finish_reason,
                    num_cached_tokens=num_cached_tokens,
                    error=error,
                ),
            )

    def _push(self, route: Route, delta: SampleDelta) -> None:
        self._deltas.setdefault(route.reply_to, []).append(delta)
        if delta.finish_reason is not None:
            route.open_indices.discard(delta.index)
            if not route.open_indices and self.routes.pop(delta.request_id, None) is not None:
                self.on_done(route)

    async def flush(self, step_id: int) -> None:
        async with self._lock:  # two flushes must not interleave one subject's batches
            deltas, self._deltas = self._deltas, {}
            for subject, batch in deltas.items():
                await self.nc.publish(subject, pack(TokenBatch(step_id, batch)))
