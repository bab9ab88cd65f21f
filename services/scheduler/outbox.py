"""Where the engine core's SampleDeltas go: each request's tokenizer replica, one TokenBatch
per subject and step (several when one would not fit the wire), in order."""

import asyncio
from collections.abc import Callable

import nats.errors
import structlog
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.tokenizer import SampleDelta, TokenBatch
from kvpager.services.fit import split_deltas
from kvpager.services.wire import pack, payload_budget
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)


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

    async def publish(self, batches: dict[str, list[SampleDelta]], step_id: int) -> set[str]:
        """Publish every subject's deltas; returns the requests whose deltas could not go (over
        the wire's limit even when cut): each got an error delta instead, the caller ends them."""
        failed: set[str] = set()
        budget = payload_budget(self.nc)
        async with self._lock:  # two publishes must not interleave one subject's batches
            for subject, batch in batches.items():
                for run in split_deltas(batch, budget):
                    failed |= await self._publish(subject, TokenBatch(step_id, run))
        return failed

    async def _publish(self, subject: str, batch: TokenBatch) -> set[str]:
        try:
            await self.nc.publish(subject, pack(batch))
            return set()
        except nats.errors.MaxPayloadError:
            failed = {delta.request_id for delta in batch.deltas}
            log.error("deltas over the wire's limit: failing their requests", requests=failed)
        error = ErrorInfo("internal_error", "the request's output is over the wire's limit")
        samples = sorted({(delta.request_id, delta.index) for delta in batch.deltas})
        errors = [SampleDelta(r, i, finish_reason="error", error=error) for r, i in samples]
        await self.nc.publish(subject, pack(TokenBatch(batch.step_id, errors)))
        return failed
