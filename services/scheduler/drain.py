"""Draining an instance: its streams move on, with their KV blocks, to the other instances.

`kvpager drain INSTANCE` asks (DrainInstance on `.scheduler.drain`), and SIGTERM does the same
when another instance is up. The scheduler refuses new requests, lets the steps in flight
come back, then hands every running stream that can move to its tokenizer with a KvHandoff
(EngineCore.hand_off); the tokenizer sends the continuation elsewhere, whose executor reads
the blocks. Streams that cannot move (parallel samples, beams, penalties) finish here.
"""

import asyncio
import time

import nats
import structlog
from kvpager.engine.core import PREFILLED, EngineCore
from kvpager.engine.frontend.migration import can_move
from kvpager.engine.request import Request
from kvpager.engine.router.routing import ROLES
from kvpager.schemas.kv_transfer import DrainResult, KvHandoff, KvPulled, KvSent
from kvpager.schemas.scheduler import ExecutorReady
from kvpager.services.discovery import SCHEDULER_STATS, scheduler_answer
from kvpager.services.settings import Settings
from kvpager.services.subjects import TRANSFER_ID
from kvpager.services.wire import pack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

GATHER_S = 0.25
STOP_SETTLE_S = 0.5  # a signal to every instance at once reaches them all within this
PEER_PATIENCE_S = 3.0  # at a stop, how long an instance seen lately may take to answer
PEER_MEMORY_S = 10.0  # "lately"
DECODE_ROLES = ("decode", "both")  # who takes a prefill instance's streams


def movable(request: Request) -> bool:
    return can_move(request.sampling_params)


def prefilled(request: Request) -> bool:
    """Its prompt is computed and its first token out: a decode instance takes it on."""
    return movable(request) and request.num_output_tokens >= 1 and not request.stays_here


async def other_instances(
    nc: NATS,
    prefix: str,
    instance: str,
    roles: tuple[str, ...] = ROLES,
    expect: frozenset[str] = frozenset(),
    patience_s: float = GATHER_S,
) -> set[str]:
    """The other instances under `prefix` (of one of `roles`, not closing, with an executor)
    that answer discovery now."""
    answers = await gather_instances(nc, prefix, expect - {instance}, patience_s)
    return {name for name, load in answers.items() if _accepts(load, roles)} - {instance}


async def gather_instances(
    nc: NATS, prefix: str, expect: frozenset[str] = frozenset(), patience_s: float = GATHER_S
) -> dict[str, dict]:
    """Every scheduler under `prefix` that answers discovery, with its load. Answers come for
    GATHER_S; on a loaded host a busy peer may answer later, so the instances in `expect`
    (seen lately) get up to `patience_s` before they count as gone."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    answers: dict[str, dict] = {}
    start = time.monotonic()
    try:
        await nc.publish(SCHEDULER_STATS, b"", reply=inbox)
        while True:
            waiting = not expect <= answers.keys()
            left = start + (max(patience_s, GATHER_S) if waiting else GATHER_S) - time.monotonic()
            if left <= 0:
                return answers
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                continue
            answers.update(_answer(msg.data, prefix))
    finally:
        await sub.unsubscribe()


def _answer(data: bytes, prefix: str) -> dict[str, dict]:
    """{instance: its load} from one $SRV.STATS answer under `prefix`; {} for another's."""
    answer = scheduler_answer(data, prefix)
    if answer is None:
        return {}
    name, load = answer
    return {name: load if isinstance(load, dict) else {}}


def _accepts(load: dict, roles: tuple[str, ...]) -> bool:
    """Up, with an executor, not shutting down (it would refuse the streams), of a role."""
    if load.get("closing") or not load.get("model"):
        return False
    return load.get("role", "both") in roles


class KvMovesService:
    """The scheduler service's side of KV moves and drains, mixed into SchedulerService:
    handoffs it accepts, transfers' ends from its executor, drains."""

    nc: NATS
    settings: Settings
    core: EngineCore | None
    executor: ExecutorReady | None
    outbox: object
    _work: asyncio.Event
    _closing: bool
    _decode_up: bool = False  # a prefill instance's: a decode instance answered lately
    _peers_seen: dict[str, float]  # the other instances that answered: when, lately

    def _importable(self, source: KvHandoff | None) -> KvHandoff | None:
        """A handoff our executor can read (another instance's, a transfer id fit for a
        subject); else None: the continuation recomputes its prompt."""
        if source is None or not self.executor.kv_agent:
            return None
        if source.instance == self.settings.instance or not TRANSFER_ID.fullmatch(
            source.transfer_id
        ):
            return None
        return source

    def _take_back(self, source: KvHandoff | None, request: Request) -> None:
        """A stream we handed on came back (no decode instance took it): it recomputes here,
        from its blocks, which the prefix cache still has once freed, and finishes here."""
        if source is None or source.instance != self.settings.instance or self.core is None:
            return
        request.stays_here = True
        if self.core.scheduler.take_back(source.transfer_id):
            log.info("handed-on stream came back", transfer_id=source.transfer_id)

    def _drop_hold(self, request_id: str, transfer_id: str) -> None:
        """A stream we handed on ended before its blocks were read (an abort, a stop string
        in its first token): free them now, not at the hold's expiry."""
        if self.core is not None and self.core.scheduler.take_back(transfer_id, request_id):
            log.info("kv hold dropped: its stream ended", transfer_id=transfer_id)
            self._work.set()

    def _on_kv(self, message: KvPulled | KvSent) -> None:
        """A transfer ended: a pull (we resume or recompute), or a peer read our handoff."""
        if self.core is None:
            return
        scheduler = self.core.scheduler
        if isinstance(message, KvSent):
            known = scheduler.release(message.transfer_id)
            log.info("kv handoff read", transfer_id=message.transfer_id, known=known)
        else:
            ok = not message.error
            scheduler.pulled(message.transfer_id, message.num_bytes, message.seconds, ok)
            if not ok:
                log.warning("kv pull failed: recomputing", transfer_id=message.transfer_id)
        self._work.set()

    async def _expire_holds(self) -> None:
        if self.core is not None and self.core.scheduler.expire_holds(time.monotonic()):
            log.warning("kv handoffs never read: their blocks are free again")
            self._work.set()

    async def _on_drain(self, msg: Msg) -> None:
        """`kvpager drain`: answer how many streams moved, with or without their blocks."""
        num_moved = await self._drain("drain asked")
        if msg.reply:
            await msg.respond(pack(DrainResult(num_moved, 0)))

    async def _drain(self, reason: str) -> int:
        """Refuse new requests, empty the pipeline, hand the running streams on."""
        self._closing = True
        core = self.core
        if core is None or self.executor is None or not self.executor.kv_agent:
            return 0
        core.paused = True
        self._work.set()
        try:
            while core.num_in_flight and core is self.core:
                await asyncio.sleep(0.005)
            if core is not self.core or self.executor is None:
                return 0
            num_moved = core.hand_off(self.settings.instance, self.executor.kv_agent, movable)
            await core.publish()
        finally:
            core.paused = False
            self._work.set()
        log.info("instance drained", reason=reason, num_moved=num_moved)
        return num_moved

    async def _drain_on_stop(self) -> None:
        """With another instance up and accepting, the running streams move there with their
        blocks. Every instance that a whole `kvpager serve` stops gets its signal at once:
        after STOP_SETTLE_S each says it is closing, so none hands its streams to another
        that will refuse them (they finish where they are, as before). The instances seen
        lately get PEER_PATIENCE_S to answer: a busy host answers late, not never."""
        if self.core is None or self.executor is None or not self.executor.kv_agent:
            return
        await asyncio.sleep(STOP_SETTLE_S)
        prefix, instance = self.settings.prefix, self.settings.instance
        now = time.monotonic()
        expect = frozenset(p for p, at in self._peers_seen.items() if now - at < PEER_MEMORY_S)
        patience = PEER_PATIENCE_S
        if await other_instances(self.nc, prefix, instance, ROLES, expect, patience):
            await self._drain("shutting down")

    async def _hand_on_prefilled(self) -> None:
        """A prefill instance (--role prefill): every stream whose prompt and first token are
        computed goes on to a decode instance with its blocks (disaggregation); streams that
        cannot move (parallel samples, beams, penalties) finish here."""
        core = self.core
        if self.settings.role != "prefill" or core is None or core.num_in_flight:
            return
        if not self._decode_up:  # none to take them: they finish here
            return
        if self.executor is None or not self.executor.kv_agent:
            return
        agent = self.executor.kv_agent
        if core.hand_off(self.settings.instance, agent, prefilled, PREFILLED):
            await core.publish()

    async def _look_for_peers(self) -> None:
        """The other instances that answer discovery, remembered for a stop's drain; a
        prefill instance hands streams on only while a decode instance (with an executor,
        not closing) answers, else they finish here."""
        prefix, instance = self.settings.prefix, self.settings.instance
        answers = await gather_instances(self.nc, prefix)
        answers.pop(instance, None)
        self._peers_seen.update(dict.fromkeys(answers, time.monotonic()))
        decode_up = any(_accepts(load, DECODE_ROLES) for load in answers.values())
        if self.settings.role == "prefill" and decode_up != self._decode_up:
            log.info("decode instances", up=decode_up, instances=sorted(answers))
        self._decode_up = decode_up

    @property
    def _busy_stopping(self) -> bool:
        """Streams to finish, or handed-on blocks not yet read."""
        held = self.core is not None and self.core.scheduler.held
        return bool(self.outbox.routes or held)
