"""A tokenizer's watch over its streams: keepalives to clients, the scheduler's liveness.

A stream whose instance's scheduler is gone, restarted or silent for `liveness_timeout`
seconds ends with an "unavailable" error (and an abort to the scheduler, in case it still
runs the request), so no client waits for tokens that will never come. After a reconnect of
our own connection, token batches may have been lost: every stream ends the same way.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from kvpager.schemas.public import ErrorInfo
from kvpager.schemas.scheduler import SchedulerInfo
from kvpager.services.liveness import PeerGone, Reconnects, Silence, ping
from kvpager.services.settings import Settings
from kvpager.services.subjects import Subjects
from kvpager.services.tokenizer.streams import Stream
from nats.aio.client import Client as NATS

log = structlog.get_logger(__name__)

KEEPALIVE_HEADERS = {"Kvpager-Keepalive": "1"}

LoseStream = Callable[[Stream, ErrorInfo], Awaitable[None]]


class StreamWatch:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        settings: Settings,
        streams: dict[str, Stream],
        lose: LoseStream,
        move: LoseStream,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.interval_s = settings.heartbeat_interval
        self.liveness_timeout = settings.liveness_timeout
        self.streams = streams  # the service's own table, read here
        self.lose = lose  # end the stream (its tokens may be lost)
        self.move = move  # its instance failed: on to another, if it can
        self.silences: dict[str, Silence] = {}  # by instance
        self.reconnects = Reconnects(nc)

    async def tick(self) -> None:
        await self.check_reconnect()
        await self._keep_alive()
        await self._check_scheduler()

    async def check_reconnect(self) -> None:
        if self.reconnects.take():
            log.warning("reconnected to NATS: ending streams that may have lost tokens")
            error = ErrorInfo("unavailable", "the tokenizer's connection to NATS was interrupted")
            await self._lose_all(list(self.streams.values()), error)

    async def _keep_alive(self) -> None:
        now = time.monotonic()
        for stream in list(self.streams.values()):
            if now - stream.last_sent_at >= self.interval_s:
                stream.last_sent_at = now
                await self.nc.publish(stream.reply_to, b"", headers=KEEPALIVE_HEADERS)

    async def _check_scheduler(self) -> None:
        by_instance: dict[str, list[Stream]] = {}
        for stream in self.streams.values():
            if stream.submitted:
                by_instance.setdefault(stream.instance, []).append(stream)
        for instance in set(self.silences) - set(by_instance):
            del self.silences[instance]
        await asyncio.gather(*(self._check_instance(i, s) for i, s in by_instance.items()))

    async def _check_instance(self, instance: str, submitted: list[Stream]) -> None:
        silence = self.silences.setdefault(instance, Silence(self.liveness_timeout))
        subject = self.subjects.for_instance(instance).scheduler_info
        try:
            reply = await ping(self.nc, subject, self.interval_s)
        except PeerGone:
            error = ErrorInfo("unavailable", "the scheduler stopped")
            await self._move_all(instance, submitted, error)
            return
        if silence.note(answered=reply is not None):
            limit = silence.limit_s
            error = ErrorInfo("unavailable", f"the scheduler did not answer for {limit} s")
            await self._move_all(instance, submitted, error)
        elif reply is not None:
            try:
                scheduler_id = msgspec.msgpack.decode(reply.data, type=SchedulerInfo).scheduler_id
            except msgspec.DecodeError:  # it answered, so it is up: its id is unknown this time
                log.warning("bad scheduler info", instance=instance, headers=reply.headers)
                return
            lost = [s for s in submitted if s.scheduler_id not in ("", scheduler_id)]
            error = ErrorInfo("unavailable", "the scheduler restarted")
            await self._move_all(instance, lost, error)

    async def _move_all(self, instance: str, streams: list[Stream], error: ErrorInfo) -> None:
        """Move the streams still submitted to `instance`: while the ping was out, a stream
        may have moved on already (its old instance failed it), and a scheduler id or a
        silence of the old instance says nothing of the new one. Seen under compose with
        replicas: streams that had just moved from b to a were moved again, with a's id
        taken for a restart of b's scheduler, and dropped for want of a third instance."""
        streams = [s for s in streams if s.instance == instance and s.submitted]
        if streams:
            log.warning("instance failed", num_streams=len(streams), reason=error.message)
        for stream in streams:
            await self.move(stream, error)

    async def _lose_all(self, streams: list[Stream], error: ErrorInfo) -> None:
        if streams:
            log.warning("streams lost", num_streams=len(streams), reason=error.message)
        for stream in streams:
            await self.lose(stream, error)
