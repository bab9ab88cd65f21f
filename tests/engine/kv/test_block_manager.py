"""Block manager: exact block ids, free-list order and ref counts (block_size 4, 8 blocks)."""

from kvpager.engine.kv.block_manager import BlockManager, CachedBlock
from kvpager.engine.request import Request
from kvpager.schemas.sampling import SamplingParams


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens))


def computed(request: Request, num_tokens: int) -> None:
    request.num_computed_tokens += num_tokens


def test_allocate_grow_free_exact_ids():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(6)))
    assert manager.allocate_slots(a, 6) == [0, 1]
    computed(a, 6)
    b = make_request("b", list(range(100, 103)))
    assert manager.allocate_slots(b, 3) == [2]
    computed(b, 3)
    # a grows by two tokens: position 6 and 7 still fit block 1; the 9th token needs a block
    a.output_token_ids += [7, 8]
    assert manager.allocate_slots(a, 2) == []
    computed(a, 2)
    a.output_token_ids += [9]
    assert manager.allocate_slots(a, 1) == [3]
    assert manager.get_block_table("a") == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 1]
    manager.free(a)  # tail first: 3, 1, 0 join the free queue's tail in that order
    assert list(manager.free_queue) == [4, 5, 6, 7, 3, 1, 0]
    manager.check_invariants()
    manager.free(b)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_allocation_fails_without_side_effects():
    manager = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    assert manager.allocate_slots(a, 9) is None
    assert manager.num_free_blocks == 2 and "a" not in manager.block_tables
    manager.check_invariants()


def test_prefix_hit_shares_blocks_and_lru_eviction():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks + 2 tokens
    a = make_request("a", prompt)
    assert manager.allocate_slots(a, 10) == [0, 1, 2]
    computed(a, 10)
    assert manager.num_cached_blocks == 2  # only full blocks are cached
    b = make_request("b", prompt[:8] + [50, 51, 52])
    hits = manager.find_cached_prefix(b)
    assert hits == [CachedBlock(0), CachedBlock(1)]
    assert manager.allocate_slots(b, 3, hits) == [3]
    assert manager.get_block_table("b") == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    manager.check_invariants()
    manager.free(a)
    manager.free(b)
    # cached blocks stay reusable while free; the free queue is LRU, each table tail first
    # (a frees 2 and drops its refs on 0 and 1; b then frees 3, 1, 0)
    assert list(manager.free_queue) == [4, 5, 6, 7, 2, 3, 1, 0]
    c = make_request("c", prompt[:8] + [7])
    assert manager.find_cached_prefix(c) == [CachedBlock(0), CachedBlock(1)]
    # a request taking 5 blocks evicts the oldest free blocks: 4, 5, 6, 7, then 2 (uncached)
    d = make_request("d", list(range(200, 220)))
    assert manager.allocate_slots(d, 20) == [4, 5, 6, 7, 2]
    assert manager.find_cached_prefix(c) == [CachedBlock(0), CachedBlock(1)]
    e = make_request("e", list(range(300, 308)))
    assert manager.allocate_slots(e, 8) == [3, 1]  # then evicts cached block 1
    assert manager.num_evictions == 1
    assert manager.find_cached_prefix(c) == [CachedBlock(0)]
    manager.check_invariants()


def test_whole_prompt_cached_still_computes_last_token():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(8))
    a = make_request("a", prompt)
    manager.allocate_slots(a, 8)
    computed(a, 8)
    b = make_request("b", prompt)
    assert manager.find_cached_prefix(b) == [
        CachedBlock(0)
    ]  # block 1 holds the last token: recompute it


def test_fork_then_copy_on_write_of_shared_tail():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_request("p", list(range(6)))
    manager.allocate_slots(parent, 6)
    computed(parent, 6)
    child = make_request("c", list(range(6)))
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    assert [manager.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    # the child writes token 7 into shared block 1: it gets a private copy (block 2)
    child.output_token_ids.append(9)
    assert manager.num_blocks_needed(child, 1) == 1
    assert manager.allocate_slots(child, 1) == [2]
    assert manager.take_ops().copy == [(1, 2)]
    assert manager.get_block_table("c") == [0, 2]
    # the parent now owns block 1 alone and writes into it in place
    parent.output_token_ids.append(8)
    assert manager.allocate_slots(parent, 1) == []
    assert manager.take_ops().copy == []
    assert [manager.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    manager.check_invariants()
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_hash_collision_guard_compares_tokens():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    # corrupt the cached content as a collision would: the hit must be refused
    manager.blocks[0].token_ids = (99, 99, 99, 99)
    b = make_request("b", list(range(9)))
    assert manager.find_cached_prefix(b) == []


def test_cache_salt_separates_prefixes():
    """A salt enters the first block's hash only; the chain carries it: other salts (and no
    salt) never hit, the same salt does, and block hashes past the first differ too."""
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    alpha = Request("alpha", prompt, SamplingParams(max_tokens=2), cache_salt="alpha")
    assert manager.allocate_slots(alpha, 9) == [0, 1, 2]
    computed(alpha, 9)
    for salt in ("beta", None):
        other = Request(f"other-{salt}", prompt, SamplingParams(max_tokens=2), cache_salt=salt)
        assert manager.find_cached_prefix(other) == []
    plain = make_request("plain", prompt)
    assert len(manager.find_cached_prefix(plain)) == 0
    assert all(a != b for a, b in zip(alpha.block_hashes, plain.block_hashes))
    again = Request("again", prompt[:8] + [99], SamplingParams(max_tokens=2), cache_salt="alpha")
    assert manager.find_cached_prefix(again) == [CachedBlock(0), CachedBlock(1)]
    manager.free(alpha)
    manager.check_invariants()
