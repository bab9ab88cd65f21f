"""HybridBlockManager: one BlockManager per KV group (engine/kv/kv_groups.py) over one pool.

Every group manager shares the first one's BlockPool (blocks, free queue, prefix cache, CPU
pool); each keeps its own block tables, and group g > 0 tags its prefix-cache hashes with g, so
a block belongs to one group at a time. The interface is BlockManager's, per group where it
hands out ids: tables and new ids are lists with one entry per group. An admission or a
step's growth takes blocks for every group at once or for none.

A prefix hit must be one length in every group: the full groups need every block of the
prefix, a sliding group only those inside the window of its end (vLLM's
find_longest_cache_hit). Starting from the full groups' hit, each sliding group shortens it
to the longest end it can serve, until all agree; shorter is always served by full groups.
A chunked group (window -C, Llama 4) takes a sliding group's part: it needs only the blocks
of the chunk the prefix ends in.
"""

from kvpager.engine.kv.block_manager import BlockManager, BlockOps
from kvpager.engine.kv.block_pool import CachedBlock
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.request import Request
from kvpager.schemas.tokenizer import KvEvent

DIGEST_BYTES = 32  # sha256: a hash longer than this is a tagged group's, never reported


def make_block_manager(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    num_cpu_blocks: int = 0,
    windows: tuple[int, ...] = (),
    enable_disk: bool = False,
    num_state_slots: int = 0,
    num_snapshot_slots: int = 0,
    state_slot_bytes: int = 0,
    host_state_rows: tuple[int, int] = (0, 0),
) -> "BlockManager | HybridBlockManager | RecurrentBlockManager":
    """One group (every model whose layers attend alike): today's BlockManager, with its
    window if every layer slides. Several: a HybridBlockManager. With recurrent layers
    (`num_state_slots` > 0), either inside a RecurrentBlockManager."""
    if num_state_slots:
        inner = make_block_manager(
            num_blocks, block_size, enable_prefix_caching, num_cpu_blocks, windows, enable_disk
        )
        return RecurrentBlockManager(
            inner, num_state_slots, num_snapshot_slots, state_slot_bytes, host_state_rows
        )
    if len(windows) <= 1:
        window = windows[0] if windows else 0
        return BlockManager(
            num_blocks, block_size, enable_prefix_caching, num_cpu_blocks, enable_disk, window
        )
    return HybridBlockManager(
        num_blocks, block_size, enable_prefix_caching, num_cpu_blocks, windows
    )


class HybridBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_cpu_blocks: int,
        windows: tuple[int, ...],
    ) -> None:
        first = BlockManager(
            num_blocks, block_size, enable_prefix_caching, num_cpu_blocks, window=windows[0]
        )
        self.groups = [first] + [
            BlockManager(
                num_blocks,
                block_size,
                enable_prefix_caching,
                window=window,
                pool=first.pool,
                hash_tag=b"g%d" % group_idx,
            )
            for group_idx, window in enumerate(windows[1:], start=1)
        ]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = first.pool
        self.cpu, self.disk = first.cpu, first.disk  # the disk tier stays off: CacheConfig

    # --- the pool, as BlockManager's

    @property
    def num_free_blocks(self) -> int:
        return self.groups[0].num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.groups[0].num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.groups[0].num_cached_blocks

    @property
    def block_tables(self) -> dict[str, list[list[int]]]:
        return {seq_id: self.get_block_table(seq_id) for seq_id in self.groups[0].block_tables}

    @property
    def swapped_tables(self) -> dict[str, list[CachedBlock]]:
        return self.groups[0].swapped_tables

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions  # every group's: they evict from one pool

    @property
    def num_copies(self) -> int:
        return sum(group.num_copies for group in self.groups)

    @property
    def num_swapped_out_blocks(self) -> int:
        return sum(group.num_swapped_out_blocks for group in self.groups)

    @property
    def num_swapped_in_blocks(self) -> int:
        return sum(group.num_swapped_in_blocks for group in self.groups)

    def get_block_table(self, request_id: str) -> list[list[int]]:
        return [group.get_block_table(request_id) for group in self.groups]

    # --- prefix hits and allocation

    def find_cached_prefix(
        self, request: Request, max_blocks: int | None = None
    ) -> list[list[CachedBlock]]:
        """One hit per group, all of one length (see the module docstring), of at most
        `max_blocks` blocks."""
        if not self.enable_prefix_caching or max_blocks == 0:
            return [[] for _ in self.groups]
        full = [g for g in self.groups if not g.window]
        sliding = [g for g in self.groups if g.window]
        length = max_blocks
        if full:
            length = min(len(g.find_cached_prefix(request, max_blocks)) for g in full)
        hits = {}
        while True:
            for group in sliding:
                hits[id(group)] = group.find_cached_prefix(request, length)
                length = len(hits[id(group)])
            if all(len(h) == length for h in hits.values()):
                break
        return [
            hits[id(g)] if g.window else g.find_cached_prefix(request, length) for g in self.groups
        ]

    @staticmethod
    def num_hit_blocks(hits: list[list[CachedBlock]]) -> int:
        return len(hits[0])

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hits=None) -> int:
        hits = hits or [[] for _ in self.groups]
        return sum(
            g.num_blocks_needed(request, num_new_tokens, h) for g, h in zip(self.groups, hits)
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hits=None
    ) -> list[list[int]] | None:
        """Room for `num_new_tokens` in every group, or None (and nothing taken)."""
        hits = [list(h) for h in hits] if hits else [[] for _ in self.groups]
        for group in self.groups:
            group.remove_skipped_blocks(request)
        needed = self.num_blocks_needed(request, num_new_tokens, hits)
        evictable = sum(g.num_evictable_hits(h) for g, h in zip(self.groups, hits))
        if needed > self.num_free_blocks - evictable:
            return None
        reserved = [g.reserve_hits(h, request) for g, h in zip(self.groups, hits)]
        return [
            g.allocate_reserved(request, num_new_tokens, h, cpu_blocks)
            for g, h, cpu_blocks in zip(self.groups, hits, reserved)
        ]

    # --- requests' lifetimes: every group alike

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def trim(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.trim(request, num_tokens)

    def can_swap_out(self, request: Request) -> bool:
        num_private = sum(g.num_private_blocks(request) for g in self.groups)
        return num_private <= self.cpu.num_available

    def swap_out(self, request: Request) -> None:
        for group in self.groups:
            group.swap_out(request)

    def num_blocks_to_resume(self, request: Request, num_new_tokens: int) -> int:
        return sum(g.num_blocks_to_resume(request, num_new_tokens) for g in self.groups)

    def swap_in(self, request: Request) -> list[list[int]]:
        return [group.swap_in(request) for group in self.groups]

    def take_ops(self) -> BlockOps:
        """Every group's operations, kind by kind (swap-outs, swap-ins, copies, in that order
        across groups too: the CPU pool reuses no block within a step)."""
        ops = BlockOps()
        for group in self.groups:
            group_ops = group.take_ops()
            ops.swap_out += group_ops.swap_out
            ops.swap_in += group_ops.swap_in
            ops.copy += group_ops.copy
        return ops

    def record_kv_events(self) -> None:
        self.pool.record_kv_events()  # one list: any group may evict another's block

    def take_kv_events(self) -> list[KvEvent]:
        """Events of the untagged group's blocks (the hashes routers know), oldest first."""
        return [e for e in self.pool.take_kv_events() if len(e.block_hash) == DIGEST_BYTES]

    def reset_prefix_cache(self) -> None:
        self.groups[0].reset_prefix_cache()

    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        owned: set[int] = set()
        for group in self.groups:
            group.count_refs(refs)
            owned |= group.cpu_owned()
            assert group.block_tables.keys() == self.groups[0].block_tables.keys()
        self.pool.check_invariants(refs, owned)
