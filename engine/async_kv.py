"""KV moves for an AsyncEngine: its scheduler's KvPulls read over a KvTransfer, and the
peers' notifications (they read our held blocks) freeing those blocks.

The in-process counterpart of the executor service's KvEndpoint (services/executor/), for a
front door that owns its loop and exchanges agent cards itself (the Dynamo worker hands them
over in `disaggregated_params`). It wraps the engine's runner: a step's pulls start once
that step ran (its swap-outs first), each ending in Scheduler.pulled; a poll frees the
blocks of held handoffs once read (Scheduler.release) or expired.

    moves = AsyncKvMoves(engine, transfer)   installs itself between core and runner
    await moves.connect(card)                 a peer's card, connected off the loop (cached)
"""

import asyncio
import time

import structlog
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.worker.kv_transfer.base import KvTransfer
from kvpager.schemas.errors import KvTransferError
from kvpager.schemas.kv_transfer import KvAgent, KvPull

log = structlog.get_logger(__name__)

PULL_TIMEOUT_S = 30.0
POLL_S = 0.02


class AsyncKvMoves:
    def __init__(self, engine: AsyncEngine, transfer: KvTransfer) -> None:
        self.engine = engine
        self.transfer = transfer
        self.card = transfer.agent()  # ours, for peers
        self.runner = engine.core.runner
        engine.core.runner = self  # submit/result/run/cancel/close pass through
        self._pulls: dict[int, list[KvPull]] = {}  # step id -> its pulls, started after it
        self._tasks: set[asyncio.Task] = set()
        self._poll_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()

    def start(self) -> None:
        self._poll_task = asyncio.get_running_loop().create_task(self._poll())

    async def connect(self, card: KvAgent) -> None:
        """Know a peer: KvTransferError if its cache differs from ours or its card is bad
        (it came from the wire: NIXL's own errors on it are ours too)."""
        async with self._connecting:  # one connect at a time: a peer is added once
            if card.name == self.transfer.name or card.name in self.transfer.peers:
                return
            try:
                await asyncio.to_thread(self.transfer.add_peer, card)  # NIXL's connect blocks
            except KvTransferError:
                raise
            except Exception as exc:
                raise KvTransferError(f"KV peer {card.name!r} refused: {exc}") from exc

    # --- the runner, with pulls after their step ------------------------------------------

    async def submit(self, step) -> None:
        if step.kv_pulls:
            self._pulls[step.step_id] = step.kv_pulls
        await self.runner.submit(step)

    async def result(self, step_id: int):
        done = await self.runner.result(step_id)
        self._start_pulls(self._pulls.pop(step_id, []))
        return done

    async def run(self, step):
        done = await self.runner.run(step)
        self._start_pulls(step.kv_pulls)
        return done

    def cancel(self) -> None:
        self.runner.cancel()

    def close(self) -> None:
        """The transfer's registrations (the runner is the engine's to close)."""
        if self._poll_task is not None:
            self._poll_task.cancel()
        self.transfer.close()

    def _start_pulls(self, pulls: list[KvPull]) -> None:
        for pull in pulls:
            task = asyncio.get_running_loop().create_task(self._pull(pull))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pull(self, pull: KvPull) -> None:
        started = time.perf_counter()
        try:
            num_bytes = await self.transfer.read(
                pull.agent, pull.remote, pull.local, pull.transfer_id, PULL_TIMEOUT_S
            )
            ok = True
        except KvTransferError as exc:  # the request recomputes; no block stays held here
            log.warning("kv pull failed", transfer_id=pull.transfer_id, error=str(exc))
            num_bytes, ok = 0, False
        seconds = time.perf_counter() - started
        self.engine.scheduler.pulled(pull.transfer_id, num_bytes, seconds, ok)
        self.engine.wake()
        if ok:
            log.info("kv pulled", transfer_id=pull.transfer_id, num_bytes=num_bytes, s=seconds)

    async def _poll(self) -> None:
        """Peers read our held blocks (their notifications) or never did: free them."""
        scheduler = self.engine.scheduler
        while True:
            try:
                for transfer_id in self.transfer.take_notifications():
                    if scheduler.release(transfer_id):
                        used = scheduler.block_manager.num_used_blocks
                        log.info("kv hold released", transfer_id=transfer_id, num_used_blocks=used)
                scheduler.expire_holds(time.monotonic())
                self.engine.on_publish()  # the freed blocks' load reaches the metrics
            except Exception:
                log.exception("kv notification poll failed")
            await asyncio.sleep(POLL_S)
