"""DiskTier: the scheduler's accounting of the disk tier under the CPU pool (no file I/O here).

    device --evict--> CPU pool --evict--> disk          (blocks_to_disk: written off the step)
    device <-swap in-- CPU pool <--load--  disk          (blocks_from_disk, then a CPU hit)

A full prefix block evicted from the CPU pool is written to disk unless it is there already.
`on_disk` holds the hashes the executor's disk holds, as far as this scheduler knows: those it
ordered written, plus what the executor reports (its folder's listing at start, files other
instances wrote, files evicted by bytes or found missing). Until the listing has arrived no
request is admitted, so a restart over a warm folder serves its first request from disk.

A request whose prefix misses on the device and in the CPU pool but goes on on disk leaves the
waiting queue while CPU blocks it reserved are filled (`StepOutput.disk_loaded`); it then goes
back to the queue's head and is admitted with those blocks as CPU hits. A failed read is a miss:
the request computes from there (a file failing its MAC too, also counted apart). Each request
tries the disk once per admission.

Reads start early: the first `prefetch_depth` queued requests have theirs issued as soon as the
scheduler sees them queued (`prefetch`), without leaving the queue. The reads overlap the
steps before their turn; at its turn a request finds the blocks read as CPU hits and waits, as
above, only for those still being read. What a request will hit in the CPU pool (its CPU hits
and the blocks read for it) is held there until it is admitted (`ReadHolds`, below):
early reads hold at most half the pool in all. A request finished or aborted meanwhile leaves
its reads to finish into the CPU pool's cache, as any read, unheld.
"""

from collections import OrderedDict

from kvpager.engine.kv.cpu_pool import CpuBlockPool
from kvpager.engine.request import Request
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.scheduler import StepOutput
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored, KvEvent

# A shorter run computes in about the step the request would wait for its read.
MIN_DISK_LOAD_BLOCKS = 2
PREFETCH_DEPTH = 8  # queued requests whose reads start before their turn (0: at their turn)


class ReadHolds:
    """The CPU-pool blocks kept for queued requests that the disk tier read for.

    A block read from disk lands in the CPU pool as a cached block, the pool's least recently used
    kind: without a hold, the swap-outs and the other reads of the steps before the request's turn
    evicted it again (in a smoke run 222 blocks were read and only 132 became hits; the rest were
    read, dropped and computed anyway). So the request holds what it will hit in the pool (its CPU
    hits and the blocks read for it) until it is admitted (they are swapped in then) or leaves;
    eviction skips held blocks (engine/kv/cpu_pool.py). Early reads (`prefetch`) hold at most half
    the pool in all, so the other half still serves swap-outs and the queue head's own reads.

    Per request it also remembers which blocks were read for it (early or at its turn): at
    admission, the reads that became hits are its disk hits (`num_disk_hit_blocks`); reads that did
    not (a failed read before them in its prefix, the request aborted, or evicted and read again)
    are counted as dropped, the disk work wasted.
    """

    def __init__(self, cpu: CpuBlockPool) -> None:
        self.cpu = cpu
        self.holds: dict[str, set[bytes]] = {}  # seq id -> hashes held for it
        self.reads: dict[str, set[bytes]] = {}  # seq id -> hashes read for it
        self.num_dropped_reads = 0  # read for a request, never its hit

    @property
    def num_held(self) -> int:
        """Distinct blocks held: cached, or still being read."""
        return len(self.cpu.held)

    def hold(self, request: Request, block_hash: bytes) -> bool:
        """Hold the block for the request; True if it was not held by anyone before."""
        held = self.holds.setdefault(request.seq_id, set())
        if block_hash in held:
            return False
        held.add(block_hash)
        fresh = block_hash not in self.cpu.held
        self.cpu.hold(block_hash)
        return fresh

    def note_read(self, request: Request, block_hash: bytes, reserved: bool) -> bool:
        """A block the request waits on or will hit from disk (`reserved` for it now, or being
        read for another); True if its hold is new."""
        reads = self.reads.setdefault(request.seq_id, set())
        if reserved and block_hash in reads:
            self.num_dropped_reads += 1  # read before, gone before its turn: read again
        reads.add(block_hash)
        return self.hold(request, block_hash)

    def admitted(self, request: Request, num_hits: int) -> None:
        """The request took its hits (its first `num_hits` blocks): its disk hits are the
        reads among them; its holds end."""
        hits = set(request.block_hashes[:num_hits])
        reads = self.reads.pop(request.seq_id, set())
        request.num_disk_hit_blocks = len(reads & hits)
        self.num_dropped_reads += len(reads - hits)
        self.release(request)

    def left(self, request: Request) -> None:
        """The request finished or was aborted while queued: its reads were for nothing."""
        self.num_dropped_reads += len(self.reads.pop(request.seq_id, ()))
        self.release(request)

    def release(self, request: Request) -> None:
        for block_hash in self.holds.pop(request.seq_id, ()):
            self.cpu.unhold(block_hash)

    def check_invariants(self) -> None:
        counts: dict[bytes, int] = {}
        for held in self.holds.values():
            for block_hash in held:
                counts[block_hash] = counts.get(block_hash, 0) + 1
        assert counts == self.cpu.held, "CPU-pool holds disagree with the requests holding"


class DiskTier:
    def __init__(self, cpu: CpuBlockPool, block_size: int, enabled: bool) -> None:
        self.cpu = cpu
        self.block_size = block_size
        self.enabled = enabled
        self.listed = not enabled  # the executor's listing has arrived
        self.on_disk: OrderedDict[bytes, None] = OrderedDict()
        self.loading: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> cpu block, tokens
        self.waiting: dict[str, tuple[Request, set[bytes]]] = {}  # seq id -> hashes awaited
        self.tried: set[str] = set()  # requests that had their read this admission
        self.prefetched: set[str] = set()  # queued requests whose reads started early
        self.prefetch_depth = PREFETCH_DEPTH
        self.num_prefetched_blocks = 0
        self.holds = ReadHolds(cpu)
        self.stores: list[DiskBlock] = []
        self.loads: list[DiskBlock] = []
        self.kv_events: list[KvEvent] | None = None
        self.num_stored_blocks = self.num_loaded_blocks = self.num_failed_loads = 0
        self.num_rejected_files = 0  # failed their MAC (forged or altered): deleted, a miss
        if enabled:
            cpu.on_evict = self._store

    @property
    def busy(self) -> bool:
        """Waiting on the executor: for its listing, or for reads."""
        return not self.listed or bool(self.waiting)

    def start_load(self, request: Request, num_hits: int) -> bool:
        """Read the blocks after the request's `num_hits` cached ones that are on disk into
        the CPU pool; True if the request now waits for them (it left the waiting queue)."""
        if not self.enabled or request.seq_id in self.tried:
            return False
        run = self._disk_run(request, num_hits)
        if len(run) < MIN_DISK_LOAD_BLOCKS:
            return False
        self._hold_cpu_hits(request, num_hits, self.cpu.num_blocks)  # the reads never evict them
        room = self.cpu.num_available
        awaited = set()
        for block_idx, block_hash in run:
            reserved = block_hash not in self.loading
            if reserved:
                if room <= 0:
                    break
                room -= 1
                self._reserve(request, block_idx, block_hash)
            self.holds.note_read(request, block_hash, reserved)
            awaited.add(block_hash)
        if not awaited:
            return False
        self.tried.add(request.seq_id)
        self.waiting[request.seq_id] = (request, awaited)
        return True

    def wants_prefetch(self, request: Request) -> bool:
        """A queued request whose early reads have not been tried (a query)."""
        return self.enabled and not (
            request.seq_id in self.prefetched or request.seq_id in self.tried
        )

    def prefetch(self, request: Request, num_hits: int) -> int:
        """Start reading a queued request's disk run (after its `num_hits` cached blocks) into
        the CPU pool ahead of its turn; it stays queued, holding its CPU hits and the blocks
        read within half the pool for all early reads. Returns the blocks newly reserved."""
        if not self.wants_prefetch(request):
            return 0
        self.prefetched.add(request.seq_id)
        run = self._disk_run(request, num_hits)
        if len(run) < MIN_DISK_LOAD_BLOCKS:
            return 0
        kept = self.cpu.held.keys() | self.loading.keys()
        room = self.cpu.num_blocks // 2 - len(kept)  # the rest of the pool serves others
        room -= self._hold_cpu_hits(request, num_hits, room)
        num_reserved = 0
        for block_idx, block_hash in run:
            if room <= 0:
                break
            reserved = block_hash not in self.loading
            if reserved:
                if self.cpu.num_available <= 0:
                    break
                self._reserve(request, block_idx, block_hash)
                num_reserved += 1
            room -= self.holds.note_read(request, block_hash, reserved)
        self.num_prefetched_blocks += num_reserved
        return num_reserved

    def _hold_cpu_hits(self, request: Request, num_hits: int, room: int) -> int:
        """Hold the request's hits in the CPU pool, the first `room` not held yet; returns how
        many were newly held."""
        num_held = 0
        for block_hash in request.block_hashes[:num_hits]:
            if num_held >= room:
                break
            if block_hash in self.cpu.cached:
                num_held += self.holds.hold(request, block_hash)
        return num_held

    def _disk_run(self, request: Request, num_hits: int) -> list[tuple[int, bytes]]:
        """(block index, hash) of the blocks after the hits that are on disk or being read."""
        hashes = request.block_hashes
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token computes
        run = []
        for block_idx in range(num_hits, min(max_blocks, len(hashes))):
            block_hash = hashes[block_idx]
            if block_hash not in self.on_disk and block_hash not in self.loading:
                break
            run.append((block_idx, block_hash))
        return run

    def _reserve(self, request: Request, block_idx: int, block_hash: bytes) -> None:
        cpu_block = self.cpu.reserve()
        assert cpu_block is not None, "a CPU block was counted available"
        start = block_idx * self.block_size
        tokens = tuple(request.all_token_ids[start : start + self.block_size])
        self.loading[block_hash] = (cpu_block, tokens)
        self.loads.append(DiskBlock(block_hash, cpu_block, list(tokens)))
        self.on_disk.move_to_end(block_hash)

    def admitted(self, request: Request, num_hits: int) -> None:
        """The request took its first `num_hits` blocks as hits (`ReadHolds`)."""
        self.holds.admitted(request, num_hits)
        self.tried.discard(request.seq_id)
        self.prefetched.discard(request.seq_id)

    def forget(self, request: Request) -> None:
        """The request finished or was aborted: it waits no more (its reads go on, into the
        CPU pool's cache)."""
        self.waiting.pop(request.seq_id, None)
        self.holds.left(request)
        self.tried.discard(request.seq_id)
        self.prefetched.discard(request.seq_id)

    def take_ops(self) -> tuple[list[DiskBlock], list[DiskBlock]]:
        """This step's writes and reads."""
        ops = self.stores, self.loads
        self.stores, self.loads = [], []
        return ops

    def apply(self, output: StepOutput) -> list[Request]:
        """The executor's news; returns the requests whose reads all finished, in queue order."""
        if not self.enabled:
            return []
        for block_hash in output.disk_loaded:
            self._finish_load(block_hash, True)
        for block_hash in output.disk_failed:
            self._finish_load(block_hash, False)
            self._remove(block_hash)
        for block_hash in output.disk_stored:
            self._add(block_hash)
        for block_hash in output.disk_removed:
            self._remove(block_hash)
        self.listed = self.listed or output.disk_listed
        self.num_rejected_files += output.disk_rejected
        resolved = set(output.disk_loaded) | set(output.disk_failed)
        ready = []
        for seq_id, (request, awaited) in list(self.waiting.items()):
            awaited -= resolved
            if not awaited:
                del self.waiting[seq_id]
                ready.append(request)
        return ready

    def _finish_load(self, block_hash: bytes, ok: bool) -> None:
        entry = self.loading.pop(block_hash, None)
        if entry is None:
            return  # not asked by this scheduler (a stale report): nothing was reserved
        cpu_block, tokens = entry
        self.cpu.finish_load(cpu_block, block_hash, tokens, ok)
        if ok:
            self.num_loaded_blocks += 1
        else:
            self.num_failed_loads += 1

    def _store(
        self, block_hash: bytes, block_id: int, tokens: tuple[int, ...], on_device: bool
    ) -> None:
        """A cached block leaves the CPU pool: write it to disk unless it is there."""
        if block_hash in self.on_disk:
            self.on_disk.move_to_end(block_hash)
            return
        self.stores.append(DiskBlock(block_hash, block_id, list(tokens), on_device))
        self.num_stored_blocks += 1
        self._add(block_hash)

    def _add(self, block_hash: bytes) -> None:
        if block_hash not in self.on_disk:
            self.on_disk[block_hash] = None
            if self.kv_events is not None:
                self.kv_events.append(BlockStored(block_hash, None, tier="disk"))

    def _remove(self, block_hash: bytes) -> None:
        if self.on_disk.pop(block_hash, 0) is None and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(block_hash, tier="disk"))

    def check_invariants(self) -> None:
        reserved = {cpu_block for cpu_block, _ in self.loading.values()}
        assert reserved == self.cpu.loading, "CPU blocks being read disagree with the reads"
        self.holds.check_invariants()
        for seq_id, (_, awaited) in self.waiting.items():
            assert awaited and awaited <= set(self.loading), f"{seq_id}: awaits no read"
