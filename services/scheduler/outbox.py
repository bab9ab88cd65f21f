"""Where the engine core's SampleDeltas go: each request's tokenizer replica, one TokenBatch
per subject and step, in order."""

import asyncio
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from schemas.tokenizer import SampleDelta, TokenBatch
from services.wire import pack


@dataclass
class Route:
    """A request's way back to its tokenizer."""

    reply_to: str
    num_open: int  # samples that have not had their final delta


class Outbox:
    """Deltas routed per tokenizer subject, published together, in order."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.routes: dict[str, Route] = {}  # by request (group) id
        self._lock = asyncio.Lock()

    def route(self, deltas: list[SampleDelta]) -> dict[str, list[SampleDelta]]:
        """Deltas by subject; a route ends with the final delta of its last sample."""
        batches: dict[str, list[SampleDelta]] = {}
        for delta in deltas:
            route = self.routes.get(delta.request_id)
            if route is None:
                continue
            batches.setdefault(route.reply_to, []).append(delta)
            if delta.finish_reason is not None:
                route.num_open -= 1
                if not route.num_open:
                    del self.routes[delta.request_id]
        return batches

    async def publish(self, batches: dict[str, list[SampleDelta]], step_id: int) -> None:
        async with self._lock:  # two publishes must not interleave one subject's batches
            for subject, batch in batches.items():
                await self.nc.publish(subject, pack(TokenBatch(step_id, batch)))
