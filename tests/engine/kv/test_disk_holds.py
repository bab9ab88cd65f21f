"""Blocks read from disk for a queued request stay in the CPU pool until its turn
(engine/kv/disk_index.py): by hand-made step outputs, then end to end on a tiny model with a
small CPU pool, where every block read early for the returning requests is their hit."""

from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.kv.block_manager import CachedBlock
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput

from tests.engine.helpers import assert_all_free
from tests.engine.kv.test_disk_index import make_request
from tests.engine.kv.test_disk_prefetch import on_disk_manager
from tests.engine.kv.test_disk_tier import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    GREEDY,
    PROMPTS,
    disk_llm,
    run_one_by_one,
)


def fill_pool(manager, num_blocks: int, first: int = 100) -> list[int | None]:
    """Device evictions arriving in the CPU pool (as a running request's growth causes)."""
    return [manager.cpu.cache(bytes([first + i]) * 32, (i, i, i, i), i) for i in range(num_blocks)]


def test_a_block_read_early_survives_pool_pressure_until_its_request_is_admitted():
    tokens = list(range(9))  # 2 full blocks on disk
    hashes = prompt_block_hashes(tokens, 4)
    manager = on_disk_manager(tokens, num_cpu_blocks=4)
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []  # as admission asks first (its hashes)
    assert manager.disk.prefetch(request, 0) == 2
    manager.take_ops()
    manager.disk.apply(StepOutput(step_id=2, disk_loaded=hashes))
    manager.take_ops()
    # six evictions into a 4-block pool: the two free blocks, then the oldest unheld entry
    # each time, never the held reads; with only held blocks left a swap-out finds no room
    assert manager.cpu.num_available == 2
    placed = fill_pool(manager, 6)
    assert [p is not None for p in placed] == [True] * 6
    assert manager.cpu.num_available == 2 and set(manager.cpu.held) == set(hashes)
    hits = manager.find_cached_prefix(request)
    assert hits == [CachedBlock(0, on_cpu=True), CachedBlock(1, on_cpu=True)]
    manager.disk.admitted(request, len(hits))
    assert request.num_disk_hit_blocks == 2 and not manager.cpu.held
    assert manager.disk.holds.num_dropped_reads == 0
    manager.check_invariants()


def test_early_reads_hold_at_most_half_the_pool_and_a_request_leaving_counts_them_dropped():
    prompts = [list(range(i * 100, i * 100 + 9)) for i in range(3)]  # 2 blocks each
    manager = on_disk_manager([t for p in prompts for t in p], num_cpu_blocks=4)
    for prompt in prompts:
        stored = prompt_block_hashes(prompt, 4)
        manager.disk.apply(StepOutput(step_id=1, disk_stored=stored, disk_listed=True))
    first, second, third = (make_request(str(i), p) for i, p in enumerate(prompts))
    for request in (first, second, third):
        assert manager.find_cached_prefix(request) == []
    assert manager.disk.prefetch(first, 0) == 2
    assert manager.disk.prefetch(second, 0) == 0  # half of the pool is held already
    manager.take_ops()
    manager.disk.apply(StepOutput(step_id=2, disk_loaded=prompt_block_hashes(prompts[0], 4)))
    assert len(manager.cpu.held) == 2
    manager.disk.forget(first)  # aborted while queued: its two reads were for nothing
    assert manager.disk.holds.num_dropped_reads == 2 and not manager.cpu.held
    assert manager.disk.prefetch(third, 0) == 2  # room again (evicting no held block)
    manager.check_invariants()


def test_the_queue_heads_reads_hold_its_cpu_hits_and_blocks_until_admission():
    tokens = list(range(13))  # 3 full blocks
    hashes = prompt_block_hashes(tokens, 4)
    manager = on_disk_manager(tokens, num_cpu_blocks=3)
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []
    assert manager.disk.start_load(request, 0)
    manager.take_ops()
    assert manager.disk.apply(StepOutput(step_id=2, disk_loaded=hashes)) == [request]
    manager.take_ops()
    assert fill_pool(manager, 2) == [None, None]  # no room: all three are held for it
    to_disk = manager.take_ops().to_disk  # so they go on to disk from the device
    assert [(b.block_hash, b.block_id, b.on_device) for b in to_disk] == [
        (bytes([100 + i]) * 32, i, True) for i in range(2)
    ]
    manager.disk.admitted(request, 3)
    assert request.num_disk_hit_blocks == 3 and not manager.cpu.held
    assert fill_pool(manager, 1) == [0]  # unheld now: the oldest goes first
    manager.check_invariants()


def test_every_block_read_early_for_queued_returning_requests_is_their_hit(tiny_llama, tmp_path):
    """One seat, a runner in it growing (its evictions fill the 8-block CPU pool), four
    returning requests queued behind it, their prefixes on disk: each early read stays until
    its request is admitted and becomes a disk hit; outputs equal those computed fresh."""
    with disk_llm(tiny_llama, tmp_path / "kv", max_num_seqs=1, swap_space=8 * BLOCK_BYTES) as llm:
        fresh = run_one_by_one(llm, PROMPTS)
        before = llm.stats()
        runner = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompts = [PROMPTS[7], *PROMPTS[:4]]
        outputs = llm.generate(prompts, [runner] + [GREEDY] * 4, use_tqdm=False)[1:]
        assert [o.outputs[0].token_ids for o in outputs] == fresh[:4]
        stats = llm.stats()
        num_read = stats["num_disk_loaded_blocks"] - before["num_disk_loaded_blocks"]
        num_early = stats["num_disk_prefetched_blocks"] - before["num_disk_prefetched_blocks"]
        num_hit = sum(o.cached_tokens_by_tier.get("disk", 0) for o in outputs) // BLOCK_SIZE
        assert num_early > 0 and stats["num_disk_failed_loads"] == 0
        assert stats["num_disk_prefetch_dropped_blocks"] == 0
        assert num_hit == num_read  # every block read, early or at the turn, was a hit
        manager = llm.scheduler.block_manager
        assert not manager.cpu.held and not manager.disk.holds.holds
        assert_all_free(llm)
