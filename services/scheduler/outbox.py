"""Where the engine core's SampleDeltas go: each request's tokenizer replica, one TokenBatch
per subject and step, in order."""

import asyncio
from collections.abc import Callable

from nats.aio.client import Client as NATS

from schemas.tokenizer import SampleDelta, TokenBatch
from services.wire import pack


class Outbox:
    """Deltas routed per tokenizer subject, published together, in order. A route lasts while
    the engine core's SampleDeltas keep its request open (some sample without a final delta)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.routes: dict[str, str] = {}  # request (group) id -> its tokenizer's subject
        self._lock = asyncio.Lock()

    def route(
        self, deltas: list[SampleDelta], is_open: Callable[[str], bool]
    ) -> dict[str, list[SampleDelta]]:
        """Deltas by subject; a request's route goes with the batch that closes it."""
        batches: dict[str, list[SampleDelta]] = {}
        finished = set()
        for delta in deltas:
            subject = self.routes.get(delta.request_id)
            if subject is None:
                continue
            batches.setdefault(subject, []).append(delta)
            if delta.finish_reason is not None:
                finished.add(delta.request_id)
        for request_id in finished:  # after the loop: one batch may close several samples
            if not is_open(request_id):
                del self.routes[request_id]
        return batches

    async def publish(self, batches: dict[str, list[SampleDelta]], step_id: int) -> None:
        async with self._lock:  # two publishes must not interleave one subject's batches
            for subject, batch in batches.items():
                await self.nc.publish(subject, pack(TokenBatch(step_id, batch)))
