"""NatsTransfer: the KV transfer interface over NATS, for when NIXL is not installed.

A read asks the peer (on its agent subject) to send the blocks' bytes to a subject of the
transfer's own, in KvChunks under the server's max_payload; the reader writes them into its
blocks and sends the peer KvTransferDone, the notification that frees them. A write announces
itself the same way and waits for the peer's KvTransferDone. Nothing from the wire is trusted:
block ids are checked against the cache, chunk offsets and sizes against the announced total.
"""

import asyncio
import time

import msgspec
import structlog
from kvpager.engine.worker.kv_transfer.base import DEFAULT_TIMEOUT_S, KvTransfer
from kvpager.engine.worker.kv_transfer.regions import GroupBlocks, KvRegions, flat_blocks
from kvpager.schemas.errors import KvTransferError
from kvpager.schemas.kv_transfer import (
    KvAgent,
    KvChunk,
    KvReadRequest,
    KvRequest,
    KvTransferDone,
    KvWriteRequest,
)
from kvpager.services.subjects import TRANSFER_ID, Subjects
from kvpager.services.wire import pack, payload_budget, unpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

CHUNK_OVERHEAD = 256  # the KvChunk around its bytes
_request_decoder = msgspec.msgpack.Decoder(KvRequest)
_stream_decoder = msgspec.msgpack.Decoder(KvChunk | KvTransferDone)


def check_transfer_id(transfer_id: str) -> str:
    if not TRANSFER_ID.fullmatch(transfer_id):
        raise KvTransferError(f"bad transfer id {transfer_id[:80]!r}")
    return transfer_id


class NatsTransfer(KvTransfer):
    backend = "nats"

    def __init__(self, regions: KvRegions, name: str, instance: str, nc: NATS, prefix: str):
        super().__init__(regions, name, instance)
        self.nc = nc
        self.subjects = Subjects(prefix)
        self._notes: list[str] = []
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.kv_agent(self.name), cb=self._on_request)
        log.warning(
            "kv transfer over NATS: NIXL is not installed, so KV blocks move as chunked NATS "
            "messages (the fallback; pip install kvpager[nixl] for NIXL)",
            agent=self.name,
        )

    def agent(self) -> KvAgent:
        return self.regions.agent(self.name, self.instance, self.backend)

    def add_peer(self, peer: KvAgent) -> None:
        if peer.backend != self.backend:
            raise KvTransferError(f"peer {peer.name} speaks {peer.backend}, not nats")
        super().add_peer(peer)

    # --- initiating ------------------------------------------------------------------------

    async def read(
        self, peer: str, remote: GroupBlocks, local: GroupBlocks, transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:  # fmt: skip
        theirs, ours = self._checked(peer, remote, local, transfer_id)
        subject = self.subjects.kv_transfer(transfer_id)
        sub = await self.nc.subscribe(subject)
        try:
            ask = KvReadRequest(transfer_id, theirs, subject)
            await self.nc.publish(self.subjects.kv_agent(peer), pack(ask))
            data = await _collect(sub, transfer_id, self.regions.num_bytes(len(ours)), timeout_s)
        finally:
            await sub.unsubscribe()
        await asyncio.to_thread(self.regions.scatter, ours, data)
        await self.nc.publish(self.subjects.kv_agent(peer), pack(KvTransferDone(transfer_id)))
        return len(data)

    async def write(
        self, peer: str, local: GroupBlocks, remote: GroupBlocks, transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:  # fmt: skip
        theirs, ours = self._checked(peer, remote, local, transfer_id)
        data = await asyncio.to_thread(self.regions.gather, ours)
        subject, inbox = self.subjects.kv_transfer(transfer_id), self.nc.new_inbox()
        done = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            ask = KvWriteRequest(transfer_id, theirs, subject, inbox, len(data))
            try:
                await self.nc.request(self.subjects.kv_agent(peer), pack(ask), timeout=timeout_s)
            except Exception as exc:  # no responders, timeout: the peer is not there
                raise KvTransferError(f"peer {peer} did not take the write: {exc!r}") from exc
            await self._send(subject, transfer_id, data)
            answer = await _next(done, time.monotonic() + timeout_s, transfer_id)
        finally:
            await done.unsubscribe()
        if not isinstance(answer, KvTransferDone) or answer.error:
            raise KvTransferError(f"peer {peer} failed the write: {getattr(answer, 'error', '')}")
        return len(data)

    def _checked(self, peer: str, remote, local, transfer_id: str):
        check_transfer_id(transfer_id)
        known = self.peers.get(peer)
        if known is None:
            raise KvTransferError(f"unknown KV transfer peer {peer!r}")
        theirs, ours = flat_blocks(remote, local)
        self.regions.check_blocks(ours, self.regions.num_blocks, "local")
        self.regions.check_blocks(theirs, known.num_blocks, f"peer {peer}'s")
        return theirs, ours

    async def _send(self, subject: str, transfer_id: str, data: bytes) -> None:
        size = max(1, payload_budget(self.nc) - CHUNK_OVERHEAD)
        for offset in range(0, len(data), size) or [0]:
            chunk = KvChunk(transfer_id, offset, len(data), data[offset : offset + size])
            await self.nc.publish(subject, pack(chunk))

    # --- answering a peer ------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        message = unpack(_request_decoder, msg.data, msg.subject)
        if message is None:
            return
        try:
            check_transfer_id(message.transfer_id)
            if isinstance(message, KvTransferDone):
                self._notes.append(message.transfer_id)
            elif isinstance(message, KvReadRequest):
                await self._serve_read(message)
            else:
                await self._serve_write(message, msg)
        except KvTransferError as exc:
            log.warning("kv transfer refused", transfer_id=message.transfer_id, error=str(exc))
            reply = getattr(message, "subject", None)
            if reply is not None and reply.startswith(self.subjects.kv_transfer("")):
                await self.nc.publish(reply, pack(KvTransferDone(message.transfer_id, str(exc))))

    async def _serve_read(self, ask: KvReadRequest) -> None:
        if ask.subject != self.subjects.kv_transfer(ask.transfer_id):
            raise KvTransferError("a read's bytes go to its transfer's own subject only")
        self.regions.check_blocks(ask.block_ids, self.regions.num_blocks, "asked")
        data = await asyncio.to_thread(self.regions.gather, ask.block_ids)
        await self._send(ask.subject, ask.transfer_id, data)

    async def _serve_write(self, ask: KvWriteRequest, msg: Msg) -> None:
        if ask.subject != self.subjects.kv_transfer(ask.transfer_id):
            raise KvTransferError("a write's bytes come on its transfer's own subject only")
        self.regions.check_blocks(ask.block_ids, self.regions.num_blocks, "written")
        expected = self.regions.num_bytes(len(ask.block_ids))
        sub = await self.nc.subscribe(ask.subject)
        await msg.respond(b"")
        error = ""
        try:
            data = await _collect(sub, ask.transfer_id, expected, DEFAULT_TIMEOUT_S)
            await asyncio.to_thread(self.regions.scatter, ask.block_ids, data)
            self._notes.append(ask.transfer_id)
        except KvTransferError as exc:
            error = str(exc)
        finally:
            await sub.unsubscribe()
        if ask.done_subject.startswith("_INBOX"):
            await self.nc.publish(ask.done_subject, pack(KvTransferDone(ask.transfer_id, error)))

    def take_notifications(self) -> list[str]:
        notes, self._notes = self._notes, []
        return notes

    def close(self) -> None:
        if self._sub is not None:
            asyncio.ensure_future(self._sub.unsubscribe())


async def _collect(sub, transfer_id: str, total: int, timeout_s: float) -> bytearray:
    """The transfer's chunks, in order, into `total` bytes; KvTransferError on anything else."""
    data, deadline = bytearray(), time.monotonic() + timeout_s
    while True:
        chunk = await _next(sub, deadline, transfer_id)
        if isinstance(chunk, KvTransferDone):
            raise KvTransferError(f"the peer failed transfer {transfer_id}: {chunk.error}")
        if chunk.transfer_id != transfer_id or chunk.total != total or chunk.offset != len(data):
            raise KvTransferError(f"transfer {transfer_id}: a chunk out of place")
        data += chunk.data
        if len(data) >= total:
            break
    if len(data) != total:
        raise KvTransferError(f"transfer {transfer_id}: {len(data)} bytes, {total} expected")
    return data


async def _next(sub, deadline: float, transfer_id: str):
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        msg = await sub.next_msg(timeout=remaining)
    except TimeoutError as exc:
        raise KvTransferError(f"KV transfer {transfer_id} timed out") from exc
    except Exception as exc:  # nats' own timeout type, a closed subscription
        raise KvTransferError(f"KV transfer {transfer_id}: {exc!r}") from exc
    message = unpack(_stream_decoder, msg.data, msg.subject)
    if message is None:
        raise KvTransferError(f"KV transfer {transfer_id}: an undecodable chunk")
    return message
