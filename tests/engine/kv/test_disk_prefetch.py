"""Disk reads issued while a request is still queued (engine/kv/disk_index.py's prefetch): the
accounting by hand-made step outputs, then end to end on a tiny model, where early reads give
the outputs and the block accounting of reads at the request's turn, and a request aborted
with its reads in flight leaks nothing."""

import asyncio
import threading

from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.config import EngineConfig
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.kv.block_manager import BlockManager, CachedBlock
from kvpager.engine.request import Request
from kvpager.kernels.cpu_block_ops import swap_blocks_cpu
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput

from tests.engine.helpers import assert_all_free
from tests.engine.kv.test_disk_index import make_request
from tests.engine.kv.test_disk_tier import BLOCK_BYTES, GREEDY, PROMPTS, disk_llm, run_one_by_one


def on_disk_manager(tokens: list[int], num_cpu_blocks: int = 4) -> BlockManager:
    manager = BlockManager(4, 4, True, num_cpu_blocks=num_cpu_blocks, enable_disk=True)
    hashes = prompt_block_hashes(tokens, 4)
    manager.disk.apply(StepOutput(step_id=1, disk_stored=hashes, disk_listed=True))
    return manager


def test_a_queued_request_reads_into_half_the_pool_and_its_turn_waits_for_the_rest():
    tokens = list(range(13))  # 3 full blocks on disk
    hashes = prompt_block_hashes(tokens, 4)
    manager = on_disk_manager(tokens)
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []  # as admission asks first (its hashes)
    assert manager.disk.prefetch(request, 0) == 2  # half of the 4 CPU blocks
    assert manager.disk.prefetch(request, 0) == 0  # once while queued
    assert not manager.disk.waiting  # it stays queued
    assert [b.block_hash for b in manager.take_ops().from_disk] == hashes[:2]
    manager.check_invariants()
    # its turn: the blocks being read are awaited, the third one is read now
    assert manager.disk.start_load(request, 0)
    assert [b.block_hash for b in manager.take_ops().from_disk] == hashes[2:]
    assert manager.disk.apply(StepOutput(step_id=2, disk_loaded=hashes[:2])) == []
    assert manager.disk.apply(StepOutput(step_id=3, disk_loaded=hashes[2:])) == [request]
    assert manager.find_cached_prefix(request) == [CachedBlock(b, on_cpu=True) for b in (0, 1, 2)]
    manager.disk.admitted(request, 3)
    assert not manager.disk.prefetched
    manager.check_invariants()


def test_a_read_landing_before_the_turn_is_a_cpu_hit_without_waiting():
    tokens = list(range(9))  # 2 full blocks
    manager = on_disk_manager(tokens)
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []  # as admission asks first (its hashes)
    assert manager.disk.prefetch(request, 0) == 2
    manager.take_ops()
    manager.disk.apply(StepOutput(step_id=2, disk_loaded=prompt_block_hashes(tokens, 4)))
    hits = manager.find_cached_prefix(request)
    assert hits == [CachedBlock(0, on_cpu=True), CachedBlock(1, on_cpu=True)]
    assert not manager.disk.start_load(request, len(hits))  # nothing left on disk to read
    manager.check_invariants()


def test_a_request_aborted_with_its_early_reads_in_flight_leaks_nothing():
    tokens = list(range(9))
    hashes = prompt_block_hashes(tokens, 4)
    manager = on_disk_manager(tokens)
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []  # as admission asks first (its hashes)
    assert manager.disk.prefetch(request, 0) == 2
    manager.take_ops()
    manager.disk.forget(request)  # aborted while queued
    manager.free(request)
    assert manager.cpu.loading == {0, 1}  # reserved until the reads report
    manager.disk.apply(StepOutput(step_id=2, disk_loaded=hashes[:1], disk_failed=hashes[1:]))
    assert not manager.cpu.loading and not manager.disk.loading and not manager.disk.prefetched
    assert manager.cpu.lookup(hashes[0], tuple(tokens[:4])) == 0  # kept as a cached block
    manager.take_ops()  # the failed read's block is free from the next step
    assert sorted(manager.cpu.free) == [1, 2, 3]
    manager.check_invariants()


RUNNER = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def returning_round(llm) -> list[list[int]]:
    """A running request holds the one seat (max_num_seqs=1) while four returning ones wait
    in the queue; the returning ones' tokens."""
    outputs = llm.generate([PROMPTS[7], *PROMPTS[:4]], [RUNNER] + [GREEDY] * 4, use_tqdm=False)
    return outputs[1:]


def test_early_reads_give_the_outputs_and_accounting_of_reads_at_the_turn(tiny_llama, tmp_path):
    results = {}
    for depth in (8, 0):
        with disk_llm(
            tiny_llama, tmp_path / f"kv{depth}", max_num_seqs=1, swap_space=8 * BLOCK_BYTES
        ) as llm:
            disk = llm.scheduler.block_manager.disk
            disk.prefetch_depth = depth
            fresh = run_one_by_one(llm, PROMPTS)
            outputs = returning_round(llm)
            assert [o.outputs[0].token_ids for o in outputs] == fresh[:4]
            assert_all_free(llm)
            assert (llm.stats()["num_disk_prefetched_blocks"] > 0) == bool(depth)
            results[depth] = (
                [o.outputs[0].token_ids for o in outputs],
                sum(o.num_cached_tokens for o in outputs),
                disk.num_failed_loads,
            )
    assert results[8][0] == results[0][0]  # token for token
    assert results[8][2] == results[0][2] == 0
    # which request hits may differ (the reads change what the small CPU pool evicts when),
    # never by less in all
    assert results[8][1] >= results[0][1] > 0


def hold_reads(engine: AsyncEngine) -> threading.Event:
    """The executor's disk reads wait for the returned event: the test, not the host's speed,
    decides when reads in flight land (the reads themselves stay real)."""
    store = engine.runner.executor.disk
    read_block, go = store._read_block, threading.Event()

    def held(*args):
        assert go.wait(30.0), "the test never let the disk reads go"
        return read_block(*args)

    store._read_block = held
    return go


async def test_requests_aborted_with_early_reads_in_flight_leak_nothing(tiny_llama, tmp_path):
    folder = tmp_path / "kv"
    with disk_llm(tiny_llama, folder, swap_space=8 * BLOCK_BYTES) as llm:
        fresh = run_one_by_one(llm, PROMPTS)  # the first prompts' blocks end up on disk
    args = dict(
        block_size=8, num_blocks=16, dtype="float32", attention_backend="torch", max_num_seqs=1,
        swap_space=8 * BLOCK_BYTES, kv_disk_dir=str(folder), kv_disk_bytes=1 << 20,
        kv_disk_key_file=str(folder.parent / "kv-disk.key"),
    )  # fmt: skip
    engine = AsyncEngine(tiny_llama, EngineConfig(**args), check_invariants=True)
    go = hold_reads(engine)
    manager = engine.scheduler.block_manager
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runner = engine.add(Request("runner", PROMPTS[7], long))  # holds the one seat
    for i in range(3):  # queued behind it from the first step on
        engine.add(Request(f"back{i}", PROMPTS[i], GREEDY))
    loop_task = asyncio.create_task(engine.run())
    try:
        for _ in range(1000):
            if manager.disk.loading:
                break
            await asyncio.sleep(0.005)
        assert manager.disk.loading and not manager.disk.waiting  # read early, still queued
        for i in range(3):
            assert engine.release(f"back{i}")
        engine.release("runner")
        assert manager.num_used_blocks == 0
        assert manager.cpu.loading  # their CPU blocks stay reserved until the reads land
        go.set()
        await _until_idle(engine)
        after = engine.add(Request("after", PROMPTS[0], GREEDY))
        token_ids = []
        while (delta := await after.get()).finish_reason is None:
            token_ids += delta.token_ids
        assert token_ids + delta.token_ids == fresh[0]  # the engine serves on, exactly
        await _until_idle(engine)
        assert not manager.cpu.loading and not manager.disk.loading and not manager.cpu.owned
        del runner
    finally:
        go.set()
        engine.stop()
        await loop_task
        engine.close()


async def _until_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if not engine.core.has_work:
            break
        await asyncio.sleep(0.01)
    assert not engine.core.has_work
    engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_early_reads_on_the_cpu_backend_come_back_exact(tiny_llama, tmp_path):
    """The cpu backend swaps with kernels/cpu_block_ops.py: the returning round, read early from
    disk and swapped in as runs of blocks, gives the torch backend's fresh tokens."""
    torch_backend = disk_llm(tiny_llama, tmp_path / "kv-torch", swap_space=8 * BLOCK_BYTES)
    with torch_backend as llm:
        fresh = run_one_by_one(llm, PROMPTS)
    with disk_llm(
        tiny_llama, tmp_path / "kv-cpu", max_num_seqs=1, swap_space=8 * BLOCK_BYTES,
        attention_backend="cpu",
    ) as llm:  # fmt: skip
        assert llm.executor.ops.swap_blocks is swap_blocks_cpu
        assert run_one_by_one(llm, PROMPTS) == fresh
        outputs = returning_round(llm)
        assert [o.outputs[0].token_ids for o in outputs] == fresh[:4]
        assert llm.scheduler.block_manager.disk.num_prefetched_blocks > 0
        assert llm.stats()["num_swapped_in_blocks"] > 0
        assert_all_free(llm)
