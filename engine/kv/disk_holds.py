"""ReadHolds: the CPU-pool blocks kept for queued requests that the disk tier read for.

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

from kvpager.engine.kv.cpu_pool import CpuBlockPool
from kvpager.engine.request import Request


class ReadHolds:
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
