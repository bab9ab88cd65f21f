"""Block pool without block tables: the free queue's order, ref counts, the prefix cache by
hash and eviction to the CPU pool (block_size 4, a few blocks). Every test ends with the
pool's invariants against the references it handed out."""

from kvpager.engine.kv.block_pool import BlockPool, CachedBlock
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored

TOKENS = (1, 2, 3, 4)


def test_pop_touch_unref_keep_the_free_queue_in_lru_order():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert [pool.pop_free() for _ in range(3)] == [(0, None), (1, None), (2, None)]
    pool.unref(1)
    pool.unref(0)  # freed later, so reused later
    assert list(pool.free_queue) == [3, 1, 0]
    pool.touch(2)  # a second table holds it
    assert pool.ref_count(2) == 2
    pool.touch(1)  # a free block taken back (a prefix hit) leaves the queue
    assert list(pool.free_queue) == [3, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (2, 2)
    pool.check_invariants(refs=[0, 1, 2, 0], owned=set())


def test_a_cached_block_is_served_until_reused_then_evicted_to_the_cpu_pool():
    pool = BlockPool(num_blocks=2, block_size=4, num_cpu_blocks=1)
    pool.record_kv_events()
    assert pool.pop_free() == (0, None)
    assert pool.can_cache(0, b"h0")
    pool.cache_block(0, b"h0", TOKENS, parent=None)
    assert not pool.can_cache(0, b"h0") and not pool.can_cache(1, b"h0")
    assert pool.lookup(b"h0", TOKENS) == CachedBlock(0)
    assert pool.lookup(b"h0", (9, 9, 9, 9)) is None  # same hash, other tokens: never served
    pool.unref(0)  # free but still cached
    assert pool.lookup(b"h0", TOKENS) == CachedBlock(0)
    assert pool.pop_free() == (1, None)  # the older free block first
    assert pool.pop_free() == (0, 0)  # its content goes to CPU block 0 first
    assert (pool.num_evictions, pool.num_cached_blocks) == (1, 0)
    assert pool.lookup(b"h0", TOKENS) == CachedBlock(0, on_cpu=True)
    assert pool.take_kv_events() == [BlockStored(b"h0", None), BlockRemoved(b"h0")]
    assert pool.take_kv_events() == []
    pool.check_invariants(refs=[1, 1], owned=set())


def test_reset_prefix_cache_drops_free_cached_blocks_only():
    pool = BlockPool(num_blocks=3, block_size=4)
    for block_id, block_hash in ((0, b"h0"), (1, b"h1")):
        assert pool.pop_free() == (block_id, None)
        pool.cache_block(block_id, block_hash, TOKENS, parent=None)
    pool.unref(1)
    pool.reset_prefix_cache()
    assert pool.cached == {b"h0": 0}  # block 0 is in use: its content stays registered
    assert pool.blocks[1].block_hash is None
    pool.check_invariants(refs=[1, 0, 0], owned=set())
