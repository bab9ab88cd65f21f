"""A tokenizer's view of the instances: discovery through nats.micro, KV events, the router.

Every scheduler registers with the NATS services framework as `kvpager-scheduler`, its
instance in the metadata and its load (InstanceLoad) as `$SRV.STATS` endpoint data. Each tick
asks `$SRV.STATS.kvpager-scheduler` and gathers the answers for a moment: an instance that
answered is up, one not heard from for `liveness_timeout` seconds is gone (the TTL). KV events
(`<prefix>.internal.*.kv.events`) keep the router's index and loads fresh between ticks;
an answer gathered during a tick is older than an event heard since the tick asked, so it
does not replace that event's load (it would undo, say, an executor attaching meanwhile).
"""

import asyncio
import time

import msgspec
import structlog
from kvpager.engine.router.routing import Router, RouterConfig
from kvpager.schemas.tokenizer import InstanceLoad, KvEvents
from kvpager.services.discovery import SCHEDULER_STATS, scheduler_answer
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.wire import unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)


_events_decoder = msgspec.msgpack.Decoder(KvEvents)


class Instances:
    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.prefix = settings.prefix
        self.window_s = min(0.25, settings.heartbeat_interval / 2)
        config = RouterConfig(
            settings.router,
            ttl_s=settings.liveness_timeout,
            overlap_weight=settings.router_overlap_weight,
            disk_hit_cost=settings.router_disk_hit_cost,
        )
        self.router = Router(config)
        self._heard_at: dict[str, float] = {}  # instance -> when its last KV events came

    async def start(self) -> None:
        await self.nc.subscribe(Subjects(self.prefix).all_kv_events, cb=self._on_events)
        await self.discover()

    async def _on_events(self, msg: Msg) -> None:
        batch = unpack(_events_decoder, msg.data, msg.subject)
        if batch is None:
            return
        self._heard_at[batch.instance] = time.monotonic()
        self.router.apply(batch)

    async def discover(self) -> None:
        """Ask every scheduler for its load; drop the instances whose TTL passed."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            asked_at = time.monotonic()
            await self.nc.publish(SCHEDULER_STATS, b"", reply=inbox)
            await asyncio.sleep(self.window_s)
            while sub.pending_msgs:
                self._on_stats((await sub.next_msg(timeout=0.01)).data, asked_at)
        finally:
            await sub.unsubscribe()
        for name in self.router.expire():
            log.info("instance gone", instance=name)

    def _on_stats(self, data: bytes, asked_at: float) -> None:
        answer = scheduler_answer(data, self.prefix)
        if answer is None:
            return
        name, data = answer
        if name not in self.router.instances:
            log.info("instance found", instance=name)
        try:
            load = msgspec.convert(data, InstanceLoad)
        except msgspec.ValidationError:
            log.warning("bad scheduler stats dropped", instance=name)
            return
        known = self.router.instances.get(name)
        if known is not None and self._heard_at.get(name, asked_at) > asked_at:
            load = known.load  # its events since we asked are fresher: only "still up"
        self.router.observe(name, load)
