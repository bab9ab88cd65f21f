"""BlockManager: the device KV blocks' free list, ref counts, block tables and prefix cache.

    logical block i of a request  --block table-->  physical block id
    token at position p  ->  block table[p // block_size], offset p % block_size

A block is either in use (ref_count > 0, listed in one or more block tables) or free (in
`free_queue`, ref_count 0). A free block may still hold cached content (`block_hash` set): it is
reused on a prefix hit until allocation needs it, oldest-freed first (LRU). Blocks shared by
several tables (prefix hits, forks) are never written: a write into a shared partly filled
block first copies it (copy-on-write), and the copy is recorded for the executor.
"""

from collections import OrderedDict
from dataclasses import dataclass

from engine.block_hash import update_block_hashes
from engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # content of a cached block, to verify hits


class BlockManager:
    """Owns all device block accounting; hands out block ids and records copy operations."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the next step
        self.num_evictions = 0


    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens (no side effects).

        The last token is never served from the cache, so at least one token is computed and
        the step produces logits for it.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hits: list[int] = []
        for block_idx, block_hash in enumerate(hashes[:max_blocks]):
            block_id = self.cached.get(block_hash)
            start = block_idx * self.block_size
            expected = tuple(tokens[start : start + self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != expected:
                break
            hits.append(block_id)
        return hits

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hits: int = 0) -> int:
        """Free blocks that `allocate_slots(request, num_new_tokens, hits)` would take."""
        table = self.block_tables.get(request.request_id, [])
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        grow = max(0, -(-total // self.block_size) - len(table) - num_hits)
        return grow + int(self._tail_needs_copy(table, request.num_computed_tokens))


    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit_blocks: list[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens; None when blocks run out.

        `hit_blocks` are prefix-cache hits for a request that holds no blocks yet; they count
        as computed. Returns the block ids new to the table (appended, or substituted by
        copy-on-write of a shared tail).
        """
        hit_blocks = list(hit_blocks)
        num_new = self.num_blocks_needed(request, num_new_tokens, len(hit_blocks))
        num_evictable_hits = sum(1 for b in hit_blocks if self.blocks[b].ref_count == 0)
        if num_new > self.num_free_blocks - num_evictable_hits:
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        for block_id in hit_blocks:
            self._touch(block_id)
        table.extend(hit_blocks)
        new_ids = self._copy_shared_tail(table, request.num_computed_tokens)
        total = request.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        grown = [self._pop_free() for _ in range(-(-total // self.block_size) - len(table))]
        table.extend(grown)
        self._cache_full_blocks(request, table, total)
        return new_ids + grown

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks (parallel samples, beams)."""
        table = list(self.block_tables[parent.request_id])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child.request_id] = table

    def free(self, request: Request) -> None:
        """Drop the request's references; unreferenced blocks join the free queue's tail.

        Tail blocks are freed first so that, among one request's blocks, the prefix (the part
        most likely to be shared again) is evicted last.
        """
        table = self.block_tables.pop(request.request_id, [])
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                self._uncache(block)


    def _tail_needs_copy(self, table: list[int], num_computed: int) -> bool:
        """The next token lands in a partly filled block that other tables also hold."""
        if num_computed % self.block_size == 0 or num_computed // self.block_size >= len(table):
            return False
        return self.blocks[table[num_computed // self.block_size]].ref_count > 1

    def _copy_shared_tail(self, table: list[int], num_computed: int) -> list[int]:
        if not self._tail_needs_copy(table, num_computed):
            return []
        idx = num_computed // self.block_size
        src = table[idx]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1
        table[idx] = dst
        self.pending_copies.append((src, dst))
        return [dst]

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._uncache(block)
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _uncache(self, block: Block) -> None:
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Register blocks that this step fills completely under their chained hash."""
        if not self.enable_prefix_caching:
            return
        hashes = update_block_hashes(request, self.block_size)
        tokens = request.all_token_ids
        for block_idx in range(min(num_tokens // self.block_size, len(hashes))):
            block = self.blocks[table[block_idx]]
            if block.block_hash is not None:
                continue
            block_hash = hashes[block_idx]
            if block_hash in self.cached:
                continue  # same content already cached in another block; keep that one
            start = block_idx * self.block_size
            block.block_hash = block_hash
            block.token_ids = tuple(tokens[start : start + self.block_size])
            self.cached[block_hash] = block.block_id

    def check_invariants(self) -> None:
        """free + used == total; ref counts equal table references; cache entries are live."""
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: free-queue membership disagrees with ref count"
            )
        assert self.num_free_blocks + sum(r > 0 for r in refs) == self.num_blocks
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale cache entry {block_id}"
