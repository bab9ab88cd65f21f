"""An executor's KV transfer endpoint over NATS: its card, its peers, its pulls.

At start it builds a NixlTransfer (or, without NIXL, the NatsTransfer fallback) over its
cache; at attach it publishes its card (KvAgent) to every executor and asks theirs, and it
connects to each peer as the card arrives, ahead of any transfer. The scheduler's KvPulls
ride on steps and start once the step ran; each ends with a KvPulled to the scheduler. A
peer's notification that it read our blocks goes to the scheduler as KvSent, which frees them.
"""

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from kvpager.engine.worker.executor import Executor
from kvpager.engine.worker.kv_transfer import nixl
from kvpager.engine.worker.kv_transfer.base import KvTransfer
from kvpager.engine.worker.kv_transfer.endpoint import executor_regions
from kvpager.schemas.errors import ConfigError, KvTransferError
from kvpager.schemas.kv_transfer import KvAgent, KvPull, KvPulled, KvSent
from kvpager.services.executor.kv_nats import NatsTransfer
from kvpager.services.settings import Settings
from kvpager.services.subjects import TRANSFER_ID, Subjects
from kvpager.services.wire import pack, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

PULL_TIMEOUT_S = 30.0
PEER_WAIT_S = 10.0  # a pull waits this long for a peer whose card has not come or connected
NOTIFY_POLL_S = 0.02
_card_decoder = msgspec.msgpack.Decoder(KvAgent)

ToScheduler = Callable[[KvPulled | KvSent], Awaitable[None]]


def make_transfer(executor: Executor, settings: Settings, nc: NATS) -> KvTransfer | None:
    """NIXL when it imports (`--kv-transfer auto`), else the NATS fallback; None when the
    cache cannot move. `--kv-transfer nixl` without NIXL is a ConfigError."""
    regions = executor_regions(executor)
    if regions is None:
        log.info("kv transfer off: tensor-parallel caches do not move yet")
        return None
    name = f"{settings.instance}-{uuid.uuid4().hex[:12]}"
    if settings.kv_transfer == "nixl" and not nixl.available():
        raise ConfigError("kv_transfer nixl: NIXL is not installed (pip install kvpager[nixl])")
    if settings.kv_transfer != "nats" and nixl.available():
        try:
            return nixl.NixlTransfer(regions, name, settings.instance)
        except KvTransferError as exc:
            if settings.kv_transfer == "nixl":
                raise ConfigError(f"kv_transfer nixl: {exc}") from exc
            log.warning("nixl unusable: the NATS fallback moves KV blocks", error=str(exc))
    return NatsTransfer(regions, name, settings.instance, nc, settings.prefix)


class KvEndpoint:
    def __init__(self, nc: NATS, settings: Settings, transfer: KvTransfer, send: ToScheduler):
        self.nc = nc
        self.subjects = Subjects(settings.prefix, settings.instance)
        self.transfer = transfer
        self.send = send  # to our scheduler
        self.card = transfer.agent()
        self._peer_seen: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._poll_task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.transfer.name

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def start(self) -> None:
        if isinstance(self.transfer, NatsTransfer):
            await self.transfer.start()
        await self.nc.subscribe(self.subjects.kv_agents, cb=self._on_card)
        await self.nc.subscribe(self.subjects.kv_agents_ask, cb=self._on_ask)
        self._poll_task = asyncio.get_running_loop().create_task(self._poll())
        log.info("kv transfer ready", agent=self.name, backend=self.transfer.backend)

    async def announce(self) -> None:
        """Our card to every executor, and theirs asked for (at attach)."""
        await self.nc.publish(self.subjects.kv_agents, pack(self.card))
        await self.nc.publish(self.subjects.kv_agents_ask, b"")

    async def _on_ask(self, msg: Msg) -> None:
        await self.nc.publish(self.subjects.kv_agents, pack(self.card))

    async def _on_card(self, msg: Msg) -> None:
        card = unpack(_card_decoder, msg.data, msg.subject)
        if card is None or card.name == self.name or card.name in self.transfer.peers:
            return
        if not TRANSFER_ID.fullmatch(card.name):  # it names a subject of the fallback's
            log.warning("kv transfer card with a bad name dropped", name=card.name[:80])
            return
        try:  # NIXL's connect blocks for a while: not on the event loop
            await asyncio.to_thread(self.transfer.add_peer, card)
        except KvTransferError as exc:
            log.warning("kv transfer peer refused", peer=card.name, error=str(exc))
            return
        self._peer_seen.setdefault(card.name, asyncio.Event()).set()

    def start_pulls(self, pulls: list[KvPull]) -> None:
        for pull in pulls:
            task = asyncio.get_running_loop().create_task(self._pull(pull))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pull(self, pull: KvPull) -> None:
        started = time.perf_counter()
        try:
            await self._wait_for_peer(pull.agent)
            num_bytes = await self.transfer.read(
                pull.agent, pull.remote, pull.local, pull.transfer_id, PULL_TIMEOUT_S
            )
        except KvTransferError as exc:
            log.warning("kv pull failed", transfer_id=pull.transfer_id, error=str(exc))
            await self.send(KvPulled(pull.transfer_id, error=str(exc) or "failed"))
            return
        seconds = time.perf_counter() - started
        log.info("kv pulled", transfer_id=pull.transfer_id, num_bytes=num_bytes, s=seconds)
        await self.send(KvPulled(pull.transfer_id, num_bytes, seconds))

    async def _wait_for_peer(self, name: str) -> None:
        if name in self.transfer.peers:
            return
        await self.nc.publish(self.subjects.kv_agents_ask, b"")
        seen = self._peer_seen.setdefault(name, asyncio.Event())
        try:
            await asyncio.wait_for(seen.wait(), PEER_WAIT_S)
        except TimeoutError as exc:
            raise KvTransferError(f"no card from KV peer {name!r}") from exc

    async def _poll(self) -> None:
        """Peers' notifications (they read our blocks) to the scheduler, as KvSent."""
        while True:
            try:
                for transfer_id in self.transfer.take_notifications():
                    await self.send(KvSent(transfer_id))
            except Exception:
                log.exception("kv notification poll failed")
            await asyncio.sleep(NOTIFY_POLL_S)

    def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        self.transfer.close()
