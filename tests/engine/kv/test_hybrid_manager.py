"""Sliding-window block accounting: exact ids freed as the window slides, window-only prefix
hits (vLLM's rule), hits agreed across a full and a sliding group, and layer grouping."""

import pytest
from kvpager.engine.config import CacheConfig
from kvpager.engine.kv.block_manager import NULL_BLOCK, BlockManager, CachedBlock
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.kv.kv_groups import kv_groups, max_blocks_per_seq
from kvpager.schemas.errors import ConfigError

from tests.engine.kv.test_block_manager import computed, make_request


def run(manager, request, num_tokens: int, step: int = 1) -> None:
    """Compute `num_tokens` more tokens of `request`, `step` at a time, as decode does."""
    for _ in range(num_tokens // step):
        assert manager.allocate_slots(request, step) is not None
        computed(request, step)
        if request.num_computed_tokens >= request.num_tokens:
            request.output_token_ids.append(7)


def test_blocks_slide_out_of_the_window_and_go_back_exactly():
    """Window 4, block size 4: the token at position p attends p - 3 .. p, so once 8 tokens
    are computed block 0 (positions 0-3) is never read again and is freed."""
    manager = BlockManager(8, 4, enable_prefix_caching=False, window=4)
    a = make_request("a", list(range(6)), max_tokens=20)
    assert manager.allocate_slots(a, 6) == [0, 1]
    computed(a, 6)
    a.output_token_ids.append(7)
    assert manager.allocate_slots(a, 1) == []  # next token 6: attends 3..6, block 0 kept
    computed(a, 1)
    a.output_token_ids.append(7)
    assert manager.allocate_slots(a, 1) == []  # token 7: attends 4..7; skipped (7-3)//4 = 1
    assert manager.get_block_table("a") == [NULL_BLOCK, 1]
    assert list(manager.free_queue)[-1] == 0
    computed(a, 1)
    run(manager, a, 12)  # the last step computes token 19, which attends 16..19: block 4
    assert manager.get_block_table("a")[:-1] == [NULL_BLOCK] * 4
    assert manager.num_used_blocks == 1
    manager.check_invariants()
    manager.free(a)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_a_window_hit_needs_only_the_windows_blocks():
    """A cached 16-token prefix whose first blocks were evicted still hits on a window of 4:
    only its last block is needed; the entries before it are NULL_BLOCK."""
    manager = BlockManager(16, 4, enable_prefix_caching=True, window=4)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks can hit
    a = make_request("a", prompt)
    run(manager, a, 17, step=17)
    manager.free(a)
    for block_id in (0, 1, 2):  # what a full-attention cache would have needed
        manager.pool.uncache(manager.blocks[block_id])
    b = make_request("b", prompt)
    hits = manager.find_cached_prefix(b)
    assert hits == [CachedBlock(NULL_BLOCK)] * 3 + [CachedBlock(3)]
    assert manager.allocate_slots(b, 1, hits) == [5]  # 0-4 were freed after 5-15
    assert manager.get_block_table("b") == [NULL_BLOCK] * 3 + [3, 5]
    manager.check_invariants()
    manager.free(b)
    manager.check_invariants()


def test_hybrid_hit_is_one_length_in_every_group():
    """Full group: blocks 0-3 of the prefix cached; the sliding group (window 4) lost its
    block for the prefix's 4th block: both agree on the 3 blocks the sliding one can serve."""
    manager = HybridBlockManager(32, 4, True, 0, windows=(0, 4))
    prompt = list(range(200, 217))
    a = make_request("a", prompt)
    run(manager, a, 17, step=17)
    full_table, sliding_table = manager.get_block_table("a")
    manager.free(a)
    sliding = manager.groups[1]
    sliding.pool.uncache(sliding.blocks[sliding_table[3]])
    b = make_request("b", prompt)
    full_hits, sliding_hits = manager.find_cached_prefix(b)
    assert [h.block_id for h in full_hits] == full_table[:3]
    assert sliding_hits == [CachedBlock(NULL_BLOCK)] * 2 + [CachedBlock(sliding_table[2])]
    assert manager.num_hit_blocks([full_hits, sliding_hits]) == 3
    assert manager.allocate_slots(b, 5, [full_hits, sliding_hits]) is not None
    manager.check_invariants()
    manager.free(b)
    manager.check_invariants()
    assert manager.num_free_blocks == 32


def test_groups_are_one_size_and_serve_every_layer():
    groups = kv_groups((8, 8, 8, 8, 8, 0), 6)
    assert groups.windows == (0, 8, 8, 8, 8, 8) and groups.num_slots == 1
    assert groups.layer_group == (1, 2, 3, 4, 5, 0)
    gemma3_1b = tuple(0 if i % 6 == 5 else 512 for i in range(26))  # 4 full, 22 sliding
    groups = kv_groups(gemma3_1b, 26)
    assert groups.num_slots == 4 and groups.windows == (0,) + (512,) * 6  # 2 slots unused
    assert kv_groups((0,) * 3, 3) == kv_groups((), 3)
    assert kv_groups((0,) * 3, 3).layer_slot == (0, 1, 2)
    assert max_blocks_per_seq((0, 16), 440, 16, 64) == 28 + 6
    assert max_blocks_per_seq((16,), 40, 16, 64) == 3


def test_negative_windows_are_config_errors():
    with pytest.raises(ConfigError, match="group_windows"):
        CacheConfig(16, 8, group_windows=(0, -1))
