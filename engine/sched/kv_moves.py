"""KV moves: a stream's blocks handed to another instance, or taken from one.

Mixed into Scheduler (engine/sched/scheduler.py), which owns the block accounting on both
sides; the executors move the bytes (engine/worker/kv_transfer/).

    source  hold(request) -> KvHandoff   the request leaves the batch, its blocks stay held
            release(transfer_id)         the peer read them (KvSent), or the hold expired
            hold_at_finish(request)      a prefill (`hold_kv`) ends at its max_tokens with its
                                         blocks held the same way; take_hold() hands them on
    target  a waiting request with `kv_import`: at admission its blocks are allocated as
            a swapped-out request's (device entries, NULL where a window let one go) and a
            KvPull rides on the step, after the step's swap-outs;
            pulled(transfer_id, ok)      it resumes with the handed-on tokens computed, as
                                         a swap-in does, or recomputes: no block stays held

An import never hashes its blocks before their bytes arrived: they enter the prefix cache
when the request resumes (allocate_slots caches the full blocks it covers).
"""

import time
import uuid
from dataclasses import dataclass

from kvpager.engine.kv.block_manager import BlockManager
from kvpager.engine.kv.block_pool import NULL_BLOCK, CachedBlock
from kvpager.engine.request import Request, RequestStatus
from kvpager.schemas.kv_transfer import KvHandoff, KvPull

HOLD_S = 120.0  # a handoff's blocks wait this long for the peer's read, then go free


@dataclass
class KvMoveStats:
    num_blocks: int = 0  # blocks that arrived (target)
    num_bytes: int = 0
    seconds: float = 0.0  # summed transfer time, for the mean latency
    num_transfers: int = 0
    num_failed: int = 0  # pulls that failed: their requests recomputed
    num_held: int = 0  # handoffs whose blocks were read (source)
    num_expired: int = 0  # handoffs whose blocks were never read in time

    @property
    def mean_ms(self) -> float:
        return round(1000 * self.seconds / self.num_transfers, 3) if self.num_transfers else 0.0


class KvMoves:
    """The scheduler's side of KV moves (see the module docstring)."""

    block_manager: object
    running: list[Request]
    waiting: object
    seqs: dict[str, Request]
    groups: dict[str, list[Request]]
    cache_config: object

    def _init_kv_moves(self) -> None:
        self.held: dict[str, tuple[Request, float]] = {}  # transfer id -> request, deadline
        self.importing: dict[str, Request] = {}  # transfer id -> request
        self.kv_pulls: list[KvPull] = []  # for the next step
        self.kv_stats = KvMoveStats()
        self.finished_holds: dict[str, KvHandoff] = {}  # request id -> its held prefill

    @property
    def _group_managers(self) -> list[BlockManager]:
        return getattr(self.block_manager, "groups", None) or [self.block_manager]

    # --- the source ----------------------------------------------------------------------

    def can_hand_off(self, request: Request) -> bool:
        """A running sample alone in its request, with no token in flight: its blocks hold
        exactly its computed tokens."""
        return (
            request.status is RequestStatus.RUNNING
            and len(self.groups.get(request.request_id, ())) == 1
            and not request.num_output_placeholders
            and not request.num_pending_forks
            and 0 < request.num_computed_tokens < request.num_tokens
        )

    def hold(self, request: Request, instance: str, agent: str) -> KvHandoff:
        """Take `request` out of the batch, its blocks held for a peer (no step in flight may
        name it: the caller waits for the pipeline to empty)."""
        assert self.can_hand_off(request), request.seq_id
        num_blocks = -(-request.num_computed_tokens // self.cache_config.block_size)
        tables = []
        for manager in self._group_managers:
            manager.trim(request, request.num_computed_tokens)
            tables.append(list(manager.get_block_table(request.seq_id)[:num_blocks]))
        self.running.remove(request)
        self.forget_at_executor(request.seq_id)
        self.lookahead.forget(request.seq_id)
        self.seqs.pop(request.seq_id, None)
        self.groups.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED_ABORTED
        transfer_id = uuid.uuid4().hex
        self.held[transfer_id] = (request, time.monotonic() + HOLD_S)
        return KvHandoff(transfer_id, instance, agent, tables, request.num_computed_tokens)

    def hold_at_finish(self, request: Request, status: RequestStatus) -> bool:
        """A prefill (`hold_kv`, one sample) that reached its max_tokens keeps its blocks
        for the decode side (take_hold), as hold() keeps a drained stream's. False: free them."""
        if not (
            request.hold_kv
            and status is RequestStatus.FINISHED_LENGTH
            and len(self.groups.get(request.request_id, ())) == 1
            and request.num_computed_tokens > 0
        ):
            return False
        num_blocks = -(-request.num_computed_tokens // self.cache_config.block_size)
        tables = []
        for manager in self._group_managers:
            manager.trim(request, request.num_computed_tokens)
            tables.append(list(manager.get_block_table(request.seq_id)[:num_blocks]))
        transfer_id = uuid.uuid4().hex
        self.held[transfer_id] = (request, time.monotonic() + HOLD_S)
        handoff = KvHandoff(transfer_id, "", "", tables, request.num_computed_tokens)
        self.finished_holds[request.request_id] = handoff
        return True

    def take_hold(self, request_id: str) -> KvHandoff | None:
        """The held prefill of `request_id` (its instance and agent for the caller to fill)."""
        return self.finished_holds.pop(request_id, None)

    def release(self, transfer_id: str) -> bool:
        """The peer read the blocks: free them. False for an unknown id."""
        held = self.held.pop(transfer_id, None)
        if held is None:
            return False
        self.block_manager.free(held[0])
        self.kv_stats.num_held += 1
        return True

    def take_back(self, transfer_id: str, request_id: str | None = None) -> bool:
        """No peer will read the blocks (disaggregation: no decode instance took the stream,
        which came back here, or the stream ended first): free them, uncounted. False for an
        unknown id, or one held for another request than `request_id` (when given)."""
        held = self.held.get(transfer_id)
        if held is None or request_id not in (None, held[0].request_id):
            return False
        del self.held[transfer_id]
        self.block_manager.free(held[0])
        return True

    def expire_holds(self, now: float) -> list[str]:
        """Free the blocks of handoffs no peer read in time."""
        expired = [tid for tid, (_, deadline) in self.held.items() if deadline <= now]
        for transfer_id in expired:
            self.block_manager.free(self.held.pop(transfer_id)[0])
            self.kv_stats.num_expired += 1
        return expired

    # --- the target ----------------------------------------------------------------------

    def _start_import(self, request: Request) -> bool:
        """Allocate the handed-on blocks and queue their pull; False: not now (too few free
        blocks). A handoff that does not fit this cache recomputes instead (True: handled)."""
        source = request.kv_import
        num_needed = sum(b != NULL_BLOCK for table in source.block_tables for b in table)
        if not self._import_fits(request, source):
            request.kv_import = None
            return False
        if num_needed + 1 > self.block_manager.num_free_blocks:
            return False
        self.waiting.popleft()
        local = []
        for manager, table in zip(self._group_managers, source.block_tables):
            ours = [NULL_BLOCK if b == NULL_BLOCK else manager.pop_free_block() for b in table]
            manager.swapped_tables[request.seq_id] = [CachedBlock(b) for b in ours]
            local.append(ours)
        request.status = RequestStatus.SWAPPED
        self.importing[source.transfer_id] = request
        remote = [[b for b in table if b != NULL_BLOCK] for table in source.block_tables]
        local = [[b for b in table if b != NULL_BLOCK] for table in local]
        self.kv_pulls.append(KvPull(source.transfer_id, source.agent, remote, local))
        return True

    def _import_fits(self, request: Request, source: KvHandoff) -> bool:
        num_blocks = -(-source.num_computed_tokens // self.cache_config.block_size)
        return (
            # recurrent layers' state does not travel with the blocks: recompute
            not self.cache_config.num_state_slots
            and 0 < source.num_computed_tokens < request.num_tokens
            and len(source.block_tables) == len(self._group_managers)
            and all(len(table) == num_blocks for table in source.block_tables)
            and all(b == NULL_BLOCK or b >= 0 for t in source.block_tables for b in t)
        )

    def pulled(self, transfer_id: str, num_bytes: int, seconds: float, ok: bool) -> bool:
        """A pull ended: the request resumes with its tokens computed, or recomputes. False
        for an unknown id."""
        request = self.importing.pop(transfer_id, None)
        if request is None:
            return False
        source, request.kv_import = request.kv_import, None
        if request.is_finished or not ok:  # aborted meanwhile, or the bytes never came
            self.block_manager.free(request)
            self.kv_stats.num_failed += not ok
            if not request.is_finished:
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
            return True
        request.num_computed_tokens = source.num_computed_tokens
        self.waiting.appendleft(request)  # SWAPPED: _swap_in resumes it with its table
        self._note_pulled(source, num_bytes, seconds)
        return True

    def _note_pulled(self, source: KvHandoff, num_bytes: int, seconds: float) -> None:
        stats = self.kv_stats
        stats.num_blocks += sum(b != NULL_BLOCK for t in source.block_tables for b in t)
        stats.num_bytes += num_bytes
        stats.seconds += seconds
        stats.num_transfers += 1

    def _import_in_flight(self, request: Request) -> bool:
        return request.kv_import is not None and any(r is request for r in self.importing.values())

    def take_kv_pulls(self) -> list[KvPull]:
        pulls, self.kv_pulls = self.kv_pulls, []
        return pulls
