"""BlockManager: one KV group's block tables and policy over a shared BlockPool.

    logical block i of a request  --block table-->  physical block id
    token at position p  ->  block table[p // block_size], offset p % block_size

The pool (engine/kv/block_pool.py) holds the blocks, their ref counts, the free queue and the
prefix cache by hash; this manager decides which blocks a request holds. Blocks shared by
several tables (prefix hits, forks) are never written: a write into a shared partly filled
block first copies it (copy-on-write). Copies and swaps are recorded as (src, dst) block-id
pairs for the executor.

A sliding-window manager (`window` > 0) frees the blocks that slide wholly out of the window
of the next token to compute: its tables keep NULL_BLOCK there, which no kernel reads (each
masks by window before it reads a block). Freed blocks keep their cached content as any free
block does, so prefix hits still find them until they are reused. Several managers may share
one pool (engine/kv/hybrid_manager.py: one per group of layers); each tags its prefix-cache
hashes so the groups never serve one another's blocks.
"""

from dataclasses import dataclass, field

import structlog
from kvpager.engine.kv.block_hash import update_block_hashes
from kvpager.engine.kv.block_pool import NULL_BLOCK, BlockPool, CachedBlock
from kvpager.engine.kv.kv_groups import num_skipped_blocks
from kvpager.engine.kv.prefix_hits import chunked_hit, full_attention_hit, sliding_window_hit
from kvpager.engine.request import Request
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.tokenizer import KvEvent

log = structlog.get_logger(__name__)


@dataclass
class BlockOps:
    """Data movement the executor carries out before a step's forward pass, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    to_disk: list[DiskBlock] = field(default_factory=list)  # snapshot first, written later
    from_disk: list[DiskBlock] = field(default_factory=list)  # read after the swaps


class BlockManager:
    """Owns the block tables; takes block ids from its pool and records block operations."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_cpu_blocks: int = 0,
        enable_disk: bool = False,
        window: int = 0,
        pool: BlockPool | None = None,
        hash_tag: bytes = b"",
    ) -> None:
        """`window`: the sliding window of every layer this manager serves (0: full attention);
        `pool`: another manager's pool, shared (by default a pool of its own); `hash_tag`:
        appended to this manager's prefix-cache hashes."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.hash_tag = hash_tag
        if pool is None:
            disk = enable_disk and enable_prefix_caching
            pool = BlockPool(num_blocks, block_size, num_cpu_blocks, disk)
        self.pool = pool
        # the pool's parts, read here (and by tests); every change goes through the pool
        self.blocks, self.free_queue, self.cached = pool.blocks, pool.free_queue, pool.cached
        self.cpu, self.disk = pool.cpu, pool.disk
        self.block_tables: dict[str, list[int]] = {}
        self.pin_progress: dict[str, int] = {}  # seq id -> prefix blocks pinned so far
        # swapped-out requests: (on_cpu, block id); shared device blocks stay referenced
        self.swapped_tables: dict[str, list[CachedBlock]] = {}
        self.ops = BlockOps()
        self.num_copies = 0  # copy-on-write block copies
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def find_cached_prefix(
        self, request: Request, max_blocks: int | None = None
    ) -> list[CachedBlock]:
        """The longest cached prefix of the request's tokens, on device or CPU (no side effects),
        of at most `max_blocks` blocks.

        The last token is never served from the cache, so at least one token is computed and
        the step produces logits for it. A sliding manager needs only the blocks inside the
        window of the prefix's end; those before it are NULL_BLOCK entries (prefix_hits.py).
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        max_blocks = limit if max_blocks is None else min(max_blocks, limit)
        tokens = request.all_token_ids
        if self.window < 0:
            return chunked_hit(self.pool, tokens, hashes, max_blocks, self.block_size, -self.window)
        if self.window:
            return sliding_window_hit(
                self.pool, tokens, hashes, max_blocks, self.block_size, self.window
            )
        return full_attention_hit(self.pool, tokens, hashes, max_blocks, self.block_size)

    def _hashes(self, request: Request) -> list[bytes]:
        hashes = update_block_hashes(request, self.block_size)
        return [h + self.hash_tag for h in hashes] if self.hash_tag else hashes

    @staticmethod
    def num_hit_blocks(hits: list[CachedBlock]) -> int:
        return len(hits)

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, hits: list[CachedBlock] = ()
    ) -> int:
        """Free device blocks that `allocate_slots(request, num_new_tokens, hits)` would take."""
        table = self.block_tables.get(request.seq_id, [])
        total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(table) - len(hits))
        num_cpu_hits = sum(hit.on_cpu for hit in hits)
        return grow + num_cpu_hits + int(self._tail_needs_copy(table, request.num_computed_tokens))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hits: list[CachedBlock] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens; None when blocks run out.

        `hits` are prefix-cache hits for a request that holds no blocks yet; they count as
        computed. Returns the block ids new to the table (appended, or substituted by
        copy-on-write of a shared tail).
        """
        hits = list(hits)
        self.remove_skipped_blocks(request)
        num_new = self.num_blocks_needed(request, num_new_tokens, hits)
        if num_new > self.num_free_blocks - self.num_evictable_hits(hits):
            return None
        cpu_blocks = self.reserve_hits(hits, request)
        return self.allocate_reserved(request, num_new_tokens, hits, cpu_blocks)

    def allocate_reserved(
        self, request: Request, num_new_tokens: int, hits: list[CachedBlock], cpu_blocks
    ) -> list[int]:
        """allocate_slots once its check passed and its hits are reserved (reserve_hits)."""
        table = self.block_tables.setdefault(request.seq_id, [])
        table.extend(self._place_hits(hits, cpu_blocks))
        new_ids = self._copy_shared_tail(table, request.num_computed_tokens)
        total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        grown = [self._pop_free() for _ in range(-(-total // self.block_size) - len(table))]
        table.extend(grown)
        self._cache_full_blocks(request, table, total)
        self._pin_prefix(request, total)
        return new_ids + grown

    def num_evictable_hits(self, hits: list[CachedBlock]) -> int:
        """Device hits sitting in the free queue: claiming them leaves fewer free blocks."""
        return sum(
            1
            for h in hits
            if not h.on_cpu and h.block_id != NULL_BLOCK and self.blocks[h.block_id].ref_count == 0
        )

    def remove_skipped_blocks(self, request: Request) -> None:
        """Sliding window: free the blocks wholly before the window of the next token to
        compute (no later query attends them); the table keeps NULL_BLOCK in their place.
        Chunked attention alike: the blocks of the chunks before the next token's."""
        if not self.window:
            return
        table = self.block_tables.get(request.seq_id)
        if not table:
            return
        num_skipped = num_skipped_blocks(request.num_computed_tokens, self.window, self.block_size)
        for block_idx in range(min(num_skipped, len(table)) - 1, -1, -1):
            if table[block_idx] == NULL_BLOCK:
                break  # freed by an earlier step, and so is everything before it
            self.pool.unref(table[block_idx])
            table[block_idx] = NULL_BLOCK

    def reserve_hits(self, hits: list[CachedBlock], request: Request) -> dict[int, int]:
        """Take CPU hits out of the pool and reference device hits, so that no eviction can
        drop them while blocks are popped; returns block index -> CPU block."""
        hashes = self._hashes(request) if any(h.on_cpu for h in hits) else []
        cpu_blocks = {i: self.cpu.take_cached(hashes[i]) for i, h in enumerate(hits) if h.on_cpu}
        for hit in hits:
            if not hit.on_cpu and hit.block_id != NULL_BLOCK:
                self.pool.touch(hit.block_id)
                self.pool.refresh_pin(hit.block_id)  # a hit keeps a pin alive
        return cpu_blocks

    def _place_hits(self, hits: list[CachedBlock], cpu_blocks: dict[int, int]) -> list[int]:
        block_ids = []
        for block_idx, hit in enumerate(hits):
            if not hit.on_cpu:
                block_ids.append(hit.block_id)
                continue
            device_block = self._pop_free()
            self.ops.swap_in.append((cpu_blocks[block_idx], device_block))
            self.num_swapped_in_blocks += 1
            block_ids.append(device_block)
        return block_ids

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks (parallel samples, beams)."""
        table = list(self.block_tables[parent.seq_id])
        for block_id in table:
            if block_id != NULL_BLOCK:
                self.pool.touch(block_id)  # in use: a reference more
        self.block_tables[child.seq_id] = table

    def free(self, request: Request) -> None:
        """Drop the request's references; unreferenced blocks join the free queue's tail.

        Tail blocks are freed first so that, among one request's blocks, the prefix (the part
        most likely to be shared again) is evicted last. A low-priority request's (priority >
        0) go to the free queue's head, prefix last there too: evicted before anyone else's.
        """
        table = self.block_tables.pop(request.seq_id, [])
        self.pin_progress.pop(request.seq_id, None)
        for entry in self.swapped_tables.pop(request.seq_id, []):
            if entry.on_cpu:
                self.cpu.release(entry.block_id)
            else:
                table.append(entry.block_id)
        low_priority = request.priority > 0
        for block_id in table if low_priority else reversed(table):
            if block_id != NULL_BLOCK:
                self.pool.unref(block_id, low_priority)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Drop the table's blocks past its first `num_tokens` slots: lookahead blocks that
        only rejected proposals reached (private and never cached: no known token is there)."""
        table = self.block_tables.get(request.seq_id, [])
        while len(table) > -(-num_tokens // self.block_size):
            block_id = table.pop()
            assert self.blocks[block_id].ref_count == 1, f"block {block_id}: shared lookahead"
            self.pool.unref(block_id)

    def can_swap_out(self, request: Request) -> bool:
        return self.num_private_blocks(request) <= self.cpu.num_available

    def num_private_blocks(self, request: Request) -> int:
        """Blocks only this request holds: what swapping it out moves to the CPU pool."""
        table = self.block_tables[request.seq_id]
        return sum(self._is_private(b) for b in table)

    def _is_private(self, block_id: int) -> bool:
        """Held by this table alone and not pinned: a pinned block stays on the device for
        whoever reads its prefix next."""
        if block_id == NULL_BLOCK or block_id in self.pool.pins:
            return False
        return self.blocks[block_id].ref_count == 1

    def swap_out(self, request: Request) -> None:
        """Move the request's private blocks to the CPU pool; shared and pinned ones stay on
        the device, referenced."""
        entries = []
        for block_id in self.block_tables.pop(request.seq_id):
            if not self._is_private(block_id):
                entries.append(CachedBlock(block_id))
                continue
            cpu_block = self.cpu.allocate()
            assert cpu_block is not None, "swap_out without can_swap_out"
            self.ops.swap_out.append((block_id, cpu_block))
            self.num_swapped_out_blocks += 1
            self.pool.unref(block_id)
            entries.append(CachedBlock(cpu_block, on_cpu=True))
        self.swapped_tables[request.seq_id] = entries

    def num_blocks_to_resume(self, request: Request, num_new_tokens: int) -> int:
        """Free device blocks that swap_in plus allocate_slots(num_new_tokens) will take."""
        entries = self.swapped_tables[request.seq_id]
        total = request.num_computed_tokens + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(entries))
        tail_idx = request.num_computed_tokens // self.block_size
        shared_tail = (
            request.num_computed_tokens % self.block_size != 0
            and tail_idx < len(entries)
            and not entries[tail_idx].on_cpu
            and self.blocks[entries[tail_idx].block_id].ref_count > 1
        )
        return sum(e.on_cpu for e in entries) + grow + int(shared_tail)

    def swap_in(self, request: Request) -> list[int]:
        """Bring a swapped-out request's blocks back; returns its whole new block table."""
        table = []
        for entry in self.swapped_tables.pop(request.seq_id):
            if not entry.on_cpu:
                table.append(entry.block_id)
                continue
            device_block = self._pop_free()
            self.ops.swap_in.append((entry.block_id, device_block))
            self.num_swapped_in_blocks += 1
            self.cpu.release(entry.block_id)
            table.append(device_block)
        self.block_tables[request.seq_id] = table
        return table

    def take_ops(self) -> BlockOps:
        """This step's block operations; CPU blocks released during it become reusable."""
        ops, self.ops = self.ops, BlockOps()
        ops.to_disk, ops.from_disk = self.disk.take_ops()
        self.cpu.end_step()
        return ops

    def record_kv_events(self) -> None:
        """From now on, record every block cached and uncached (for KV-aware routers)."""
        self.pool.record_kv_events()

    def take_kv_events(self) -> list[KvEvent]:
        """The events since the last call, oldest first within each tier."""
        return self.pool.take_kv_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def _tail_needs_copy(self, table: list[int], num_computed: int) -> bool:
        """The next token lands in a partly filled block that other tables also hold."""
        if num_computed % self.block_size == 0 or num_computed // self.block_size >= len(table):
            return False
        return self.blocks[table[num_computed // self.block_size]].ref_count > 1

    def _copy_shared_tail(self, table: list[int], num_computed: int) -> list[int]:
        if not self._tail_needs_copy(table, num_computed):
            return []
        idx = num_computed // self.block_size
        src, dst = table[idx], self._pop_free()
        self.pool.unref(src)  # still held by the other tables
        table[idx] = dst
        self.ops.copy.append((src, dst))
        self.num_copies += 1
        return [dst]

    def pop_free_block(self) -> int:
        """A free block for the caller's own table (a KV import); see _pop_free."""
        return self._pop_free()

    def _pop_free(self) -> int:
        """A free block; content it held that the CPU pool keeps is swapped out first."""
        block_id, cpu_block = self.pool.pop_free()
        if cpu_block is not None:
            self.ops.swap_out.append((block_id, cpu_block))
            self.num_swapped_out_blocks += 1
        return block_id

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Register blocks that this step fills completely under their chained hash."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(request)
        tokens = request.all_token_ids
        for block_idx in range(min(num_tokens // self.block_size, len(hashes))):
            block_id = table[block_idx]
            if block_id == NULL_BLOCK or not self.pool.can_cache(block_id, hashes[block_idx]):
                continue
            start = block_idx * self.block_size
            token_ids = tuple(tokens[start : start + self.block_size])
            parent = hashes[block_idx - 1] if block_idx else None
            self.pool.cache_block(block_id, hashes[block_idx], token_ids, parent)

    def _pin_prefix(self, request: Request, num_tokens: int) -> None:
        """Pin the full blocks of the request's pinned prefix computed by now (pins.py). The
        whole prefix must fit the bounds when the request first pins: if not, it runs
        unpinned (`pin_tokens` = 0, so its usage reports no cache write)."""
        if not request.pin_tokens or not self.enable_prefix_caching:
            return
        hashes = self._hashes(request)
        num_pin_blocks = min(request.pin_tokens // self.block_size, len(hashes))
        start = self.pin_progress.get(request.seq_id)
        if start is None and not self._pin_fits(request, hashes[:num_pin_blocks]):
            request.pin_tokens = 0
            return
        end = min(num_pin_blocks, num_tokens // self.block_size)
        pins = self.pool.pins
        for block_hash in hashes[start or 0 : end]:
            if block_hash not in self.cached:
                continue  # a sliding window's block already reused
            if not self.pool.is_pinned(block_hash) and not pins.room(request.cache_salt):
                continue  # others pinned since this request's check
            is_new = self.pool.pin(block_hash, request.pin_ttl, request.cache_salt)
            if is_new and not self.hash_tag:  # usage counts the untagged group's tokens
                request.num_cache_write_tokens += self.block_size
        self.pin_progress[request.seq_id] = max(start or 0, end)

    def _pin_fits(self, request: Request, hashes: list[bytes]) -> bool:
        num_new = sum(not self.pool.is_pinned(h) for h in hashes)
        room = self.pool.pins.room(request.cache_salt)
        if num_new <= room:
            return True
        log.info("pin refused: over quota", request_id=request.seq_id, blocks=num_new, room=room)
        return False

    def check_invariants(self) -> None:
        """free + used == total; ref counts equal table references; caches point at live data."""
        refs = [0] * self.num_blocks
        self.count_refs(refs)
        self.pool.check_invariants(refs, self.cpu_owned())

    def cpu_owned(self) -> set[int]:
        """CPU blocks this manager's swapped-out requests own."""
        return {e.block_id for t in self.swapped_tables.values() for e in t if e.on_cpu}

    def count_refs(self, refs: list[int]) -> None:
        """Add this manager's table references to `refs` (one count per block id)."""
        for table in self.block_tables.values():
            for block_id in table:
                if block_id != NULL_BLOCK:
                    refs[block_id] += 1
        for entries in self.swapped_tables.values():
            for entry in entries:
                if not entry.on_cpu and entry.block_id != NULL_BLOCK:
                    refs[entry.block_id] += 1
