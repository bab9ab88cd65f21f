"""Chunked local attention's block accounting (window -C): the blocks of finished chunks are
freed, exact ids; prefix hits need only the blocks of the chunk the prefix ends in; a full and
a chunked group agree on one hit length; chunked groups sort after full and sliding ones."""

from kvpager.engine.kv.block_manager import NULL_BLOCK, BlockManager, CachedBlock
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.kv.kv_groups import kv_groups, max_blocks_per_seq, num_skipped_blocks

from tests.engine.kv.test_block_manager import computed, make_request
from tests.engine.kv.test_hybrid_manager import run


def test_finished_chunks_go_back_exactly():
    """Chunks of 8, blocks of 4: once token 8 is next, chunk 0 (blocks 0 and 1) is freed."""
    manager = BlockManager(8, 4, enable_prefix_caching=False, window=-8)
    a = make_request("a", list(range(6)), max_tokens=20)
    assert manager.allocate_slots(a, 6) == [0, 1]
    computed(a, 6)
    a.output_token_ids.append(7)
    run(manager, a, 2)  # tokens 6 and 7: still chunk 0
    assert manager.get_block_table("a") == [0, 1]
    assert manager.allocate_slots(a, 1) == [2]  # token 8 starts chunk 1: blocks 0, 1 freed
    assert manager.get_block_table("a") == [NULL_BLOCK, NULL_BLOCK, 2]
    computed(a, 1)
    a.output_token_ids.append(7)
    run(manager, a, 8)  # token 16 starts chunk 2
    assert manager.get_block_table("a") == [NULL_BLOCK] * 4 + [manager.get_block_table("a")[4]]
    assert manager.num_used_blocks == 1
    manager.free(a)
    manager.check_invariants()
    assert manager.num_free_blocks == 8


def test_a_chunked_hit_needs_only_its_chunks_blocks():
    """A cached 24-token prefix (chunks of 8, blocks of 4) with blocks 0-3 evicted still hits:
    its next token (24) starts chunk 3 and sees none of it, so only its last block is required
    (the sliding rule's one); with that one evicted too, the 20-token prefix ends inside chunk
    2 and needs block 4 only."""
    manager = BlockManager(16, 4, enable_prefix_caching=True, window=-8)
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks can hit
    a = make_request("a", prompt)
    run(manager, a, 25, step=25)
    manager.free(a)
    for block_id in (0, 1, 2, 3):
        manager.pool.uncache(manager.blocks[block_id])
    b = make_request("b", prompt)
    hits = manager.find_cached_prefix(b)
    assert hits == [CachedBlock(NULL_BLOCK)] * 5 + [CachedBlock(5)]  # at least its last block
    manager.pool.uncache(manager.blocks[5])
    hits = manager.find_cached_prefix(b)
    assert hits == [CachedBlock(NULL_BLOCK)] * 4 + [CachedBlock(4)]
    assert manager.allocate_slots(b, 5, hits) is not None
    manager.check_invariants()
    manager.free(b)
    manager.check_invariants()


def test_full_and_chunked_groups_agree_on_one_hit():
    manager = HybridBlockManager(32, 4, True, 0, windows=(0, -8))
    prompt = list(range(200, 217))
    a = make_request("a", prompt)
    run(manager, a, 17, step=17)
    full_table, chunked_table = manager.get_block_table("a")
    manager.free(a)
    chunked = manager.groups[1]
    chunked.pool.uncache(chunked.blocks[chunked_table[3]])  # the 4th block of the chunked group
    b = make_request("b", prompt)
    full_hits, chunked_hits = manager.find_cached_prefix(b)
    # 4 blocks end on a chunk edge and need their last (3, evicted); 3 end inside chunk 1: 2
    assert [h.block_id for h in full_hits] == full_table[:3]
    assert chunked_hits == [CachedBlock(NULL_BLOCK)] * 2 + [CachedBlock(chunked_table[2])]
    assert manager.allocate_slots(b, 5, [full_hits, chunked_hits]) is not None
    manager.check_invariants()
    manager.free(b)
    manager.check_invariants()
    assert manager.num_free_blocks == 32


def test_grouping_and_peaks():
    groups = kv_groups((-16, 0, -16, 8), 4)
    assert groups.windows == (0, 8, -16, -16)
    assert num_skipped_blocks(31, -16, 8) == 2 and num_skipped_blocks(32, -16, 8) == 4
    # 240 tokens, steps of 8: full 30 blocks; a chunk of 16 at most 3 blocks with a step
    assert max_blocks_per_seq((0, -16), 240, 8, 8) == 30 + 3
    assert max_blocks_per_seq((0, -16), 240, 8, 1) == 30 + 2
