"""The scheduler's KV events and load, for every tokenizer's router.

After each step, what the block manager cached and evicted goes out on
`<prefix>.internal.<instance>.kv.events` as one numbered `KvEvents` (numbered per scheduler id,
from 0, so a router sees a gap), together with the load; a load change alone goes out too.
A new engine core (the executor attached or restarted) starts with `CacheCleared`. Events too
many for one message (a disk tier's listing) go in several, numbered in turn.
"""

from kvpager.engine.core import EngineCore
from kvpager.schemas.scheduler import ExecutorReady
from kvpager.schemas.tokenizer import CacheCleared, InstanceLoad, KvEvent, KvEvents
from kvpager.services.wire import pack, pack_within, payload_budget
from nats.aio.client import Client as NATS


def instance_load(
    core: EngineCore | None, ready: ExecutorReady | None, role: str = "both"
) -> InstanceLoad:
    if core is None or ready is None:
        return InstanceLoad(role=role)
    scheduler = core.scheduler
    return InstanceLoad(
        model=ready.model,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=scheduler.block_manager.num_free_blocks,
        num_blocks=scheduler.block_manager.num_blocks,
        block_size=scheduler.block_manager.block_size,
        num_pinned_free_blocks=len(scheduler.block_manager.pool.pinned_free),
        role=role,
    )


class KvEventPublisher:
    def __init__(
        self, nc: NATS, subject: str, instance: str, scheduler_id: str, role: str = "both"
    ) -> None:
        self.nc = nc
        self.role = role
        self.subject = subject
        self.instance = instance
        self.scheduler_id = scheduler_id
        self._seq = 0
        self._pending: list[KvEvent] = []
        self._last_load: InstanceLoad | None = None

    def cleared(self, core: EngineCore) -> None:
        """A new core: nothing is cached; record what it caches from now on."""
        core.scheduler.block_manager.record_kv_events()
        self._pending = [CacheCleared()]

    async def publish(self, core: EngineCore | None, ready: ExecutorReady | None) -> None:
        """What changed since the last publish, if anything did."""
        if core is not None:
            self._pending += core.scheduler.block_manager.take_kv_events()
        load = instance_load(core, ready, self.role)
        if not self._pending and load == self._last_load:
            return
        runs = pack_within(self._pending, payload_budget(self.nc) - len(pack(load))) or [[]]
        self._pending, self._last_load = [], load
        for events in runs:
            batch = KvEvents(self.instance, self.scheduler_id, self._seq, events, load)
            self._seq += 1
            await self.nc.publish(self.subject, pack(batch))
