"""NixlTransfer: KV blocks over NIXL (UCX backend), DRAM on CPU and VRAM on CUDA.

The whole cache tensor is registered once; every (slot, K/V, block) region of ours and of each
peer is prepared once as a descriptor list, so a transfer names region indices only. The
initiator attaches the transfer id as NIXL's notification, which reaches the other side when
the bytes have landed. The agent is built without NIXL's own locking, and peers connect on a
worker thread while transfers and notifications run on the event loop: `_lock` serializes
every agent call, and the loop only ever tries it (it never waits on a connect).
`nixl-cu12` is an optional extra (kvpager[nixl]): `available()` says
whether it imports.
"""

import asyncio
import importlib
import logging
import threading
import time

import structlog
from kvpager.engine.worker.kv_transfer.base import DEFAULT_TIMEOUT_S, KvTransfer
from kvpager.engine.worker.kv_transfer.regions import GroupBlocks, KvRegions, flat_blocks
from kvpager.schemas.errors import KvTransferError
from kvpager.schemas.kv_transfer import KvAgent

log = structlog.get_logger(__name__)

NIXL_MODULES = ("nixl_cu12", "nixl")  # the wheel's own name, then the meta package's
POLL_S = 0.0005


def import_nixl():
    """NIXL's Python API, or None when no NIXL wheel is installed."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        _quiet_logger()
        return module
    return None


def _quiet_logger() -> None:
    """NIXL's Python logger prints INFO lines of its own format to stdout; ours are JSON.
    Its warnings and errors go through the process's logging (structlog) instead."""
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = True


def available() -> bool:
    return import_nixl() is not None


class NixlTransfer(KvTransfer):
    backend = "nixl"

    def __init__(self, regions: KvRegions, name: str, instance: str) -> None:
        super().__init__(regions, name, instance)
        nixl = import_nixl()
        if nixl is None:
            raise KvTransferError("NIXL is not installed (pip install kvpager[nixl])")
        try:  # no plugins, no UCX, memory it cannot register: NIXL raises plain errors
            self._register(nixl, name)
        except KvTransferError:
            raise
        except Exception as exc:
            raise KvTransferError(f"NIXL could not register the KV cache: {exc}") from exc
        self._remote: dict[str, object] = {}  # peer name -> its prepared descriptor list
        self._lock = threading.Lock()  # one agent call at a time (see the module's docstring)

    def _register(self, nixl, name: str) -> None:
        """The agent, the whole cache registered, and our regions prepared once."""
        regions = self.regions
        self.nixl = _agent(nixl, name)
        if "UCX" not in self.nixl.backends:
            raise KvTransferError("NIXL has no UCX backend here")
        cache, mem_type = regions.kv_cache, regions.mem_type
        whole = [(cache.data_ptr(), cache.numel() * cache.element_size(), regions.device_id, "")]
        self._registered = self.nixl.register_memory(whole, mem_type)
        ours = regions.descriptors(cache.data_ptr(), regions.num_blocks, regions.device_id)
        self._local = self.nixl.prep_xfer_dlist("NIXL_INIT_AGENT", ours, mem_type)

    def agent(self) -> KvAgent:
        metadata = self.nixl.get_agent_metadata()
        return self.regions.agent(self.name, self.instance, self.backend, metadata)

    def add_peer(self, peer: KvAgent) -> None:
        """Load its metadata, prepare its regions, and connect now: the first transfer to a
        new peer otherwise pays for the connection (about 2 s on a busy host)."""
        if peer.backend != self.backend or not peer.metadata:
            raise KvTransferError(f"peer {peer.name} speaks {peer.backend}, not nixl")
        self.regions.check_peer(peer)
        if peer.name not in self._remote:
            try:
                with self._lock:
                    self._connect(peer)
            except KvTransferError:
                raise
            except Exception as exc:  # nixl's own errors
                raise KvTransferError(f"NIXL could not connect to {peer.name}: {exc}") from exc
        # known to `read` only once connected: a pull that finds it in `peers` must not find
        # its descriptors missing (the endpoint waits for `peers`, this runs on a thread)
        super().add_peer(peer)

    def _connect(self, peer: KvAgent) -> None:
        name = self.nixl.add_remote_agent(peer.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer.name:
            self.nixl.remove_remote_agent(name)
            raise KvTransferError(f"peer {peer.name}: its NIXL metadata names {name!r}")
        theirs = self.regions.descriptors(peer.base_address, peer.num_blocks, peer.device_id)
        prepared = self.nixl.prep_xfer_dlist(name, theirs, peer.mem_type)
        try:
            self.nixl.make_connection(name)
        except Exception:
            self.nixl.release_dlist_handle(prepared)
            self.nixl.remove_remote_agent(name)
            raise
        self._remote[name] = prepared
        log.info("kv transfer peer connected", peer=name, backend=self.backend)

    def remove_peer(self, name: str) -> None:
        super().remove_peer(name)
        with self._lock:
            prepared = self._remote.pop(name, None)
            if prepared is not None:
                self.nixl.release_dlist_handle(prepared)
                self.nixl.remove_remote_agent(name)

    async def read(
        self,
        peer: str,
        remote: GroupBlocks,
        local: GroupBlocks,
        transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        theirs, ours = flat_blocks(remote, local)
        return await self._transfer("READ", peer, ours, theirs, transfer_id, timeout_s)

    async def write(
        self,
        peer: str,
        local: GroupBlocks,
        remote: GroupBlocks,
        transfer_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        theirs, ours = flat_blocks(remote, local)
        return await self._transfer("WRITE", peer, ours, theirs, transfer_id, timeout_s)

    async def _transfer(
        self, op: str, peer: str, ours: list[int], theirs: list[int], transfer_id: str,
        timeout_s: float,
    ) -> int:  # fmt: skip
        handle = await self._call(self._prepare, op, peer, ours, theirs, transfer_id)
        try:
            await self._run(handle, peer, transfer_id, timeout_s)
        finally:
            await self._call(_release, handle)
        return self.regions.num_bytes(len(ours))

    def _prepare(self, op: str, peer: str, ours: list[int], theirs: list[int], transfer_id: str):
        known = self.peers.get(peer)
        if known is None or peer not in self._remote:
            raise KvTransferError(f"unknown KV transfer peer {peer!r}")
        regions = self.regions
        regions.check_blocks(ours, regions.num_blocks, "local")
        regions.check_blocks(theirs, known.num_blocks, f"peer {peer}'s")
        local_index = regions.region_index(ours, regions.num_blocks)
        remote_index = regions.region_index(theirs, known.num_blocks)
        try:
            return self.nixl.make_prepped_xfer(
                op, self._local, local_index, self._remote[peer], remote_index,
                transfer_id.encode(),
            )  # fmt: skip
        except Exception as exc:  # nixl's own errors: no typed hierarchy to catch
            raise KvTransferError(f"NIXL could not prepare the transfer: {exc}") from exc

    async def _run(self, handle, peer: str, transfer_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            state = await self._call(self.nixl.transfer, handle)
            while state == "PROC" and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                state = await self._call(self.nixl.check_xfer_state, handle)
        except Exception as exc:
            raise KvTransferError(f"NIXL transfer {transfer_id} failed: {exc}") from exc
        if state == "PROC":
            raise KvTransferError(f"KV transfer {transfer_id} to {peer} timed out ({timeout_s} s)")
        if state != "DONE":
            raise KvTransferError(f"NIXL transfer {transfer_id} with {peer} failed ({state})")

    async def _call(self, call, *args):
        """`call(*args)` under the agent's lock, taken without blocking the event loop: a
        peer's connect on a worker thread may hold it for a while."""
        while not self._lock.acquire(blocking=False):
            await asyncio.sleep(POLL_S)
        try:
            return call(*args)
        finally:
            self._lock.release()

    def take_notifications(self) -> list[str]:
        if not self._lock.acquire(blocking=False):  # a connect runs: they keep till next poll
            return []
        try:
            notes = self.nixl.get_new_notifs()
        finally:
            self._lock.release()
        return [message.decode() for messages in notes.values() for message in messages]

    def close(self) -> None:
        for name in list(self._remote):
            self.remove_peer(name)
        with self._lock:
            self.nixl.release_dlist_handle(self._local)
            self.nixl.deregister_memory(self._registered)


PROGRESS_DELAY_US = 1000


def _agent(nixl, name: str):
    """A UCX agent whose progress thread sleeps PROGRESS_DELAY_US between polls. NIXL's
    Python API sets the delay to 0, a thread spinning on a fifth of a core while idle; without
    the thread a peer's reads of our blocks stall (over TCP the holder must progress them).
    The delay is set through the one config object the API builds."""
    config = nixl.nixl_agent_config(backends=["UCX"])
    bind = getattr(getattr(nixl, "_api", None), "nixlBind", None)
    if bind is None:  # another packaging of the API: its own delay, then
        return nixl.nixl_agent(name, config)
    original = bind.nixlAgentConfig

    class Config(original):
        def __setattr__(self, field: str, value) -> None:
            super().__setattr__(field, PROGRESS_DELAY_US if field == "pthrDelay" else value)

    bind.nixlAgentConfig = Config
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bind.nixlAgentConfig = original


def _release(handle) -> None:
    try:
        handle.release()
    except Exception as exc:  # a transfer still in flight: NIXL aborts it or refuses
        log.warning("kv transfer handle not released", error=str(exc))
