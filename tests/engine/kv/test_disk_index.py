"""The disk tier's accounting in the block manager: exact writes and reads it asks for, driven
by hand-made step outputs (block_size 4, 4 device blocks)."""

from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.engine.kv.block_manager import BlockManager, CachedBlock
from kvpager.engine.request import Request
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import StepOutput
from kvpager.schemas.tokenizer import BlockRemoved, BlockStored


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def run_and_free(manager: BlockManager, request: Request) -> None:
    assert manager.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    manager.free(request)


def test_blocks_leaving_the_cpu_pool_are_written_from_where_their_bytes_are():
    manager = BlockManager(4, 4, True, num_cpu_blocks=1, enable_disk=True)
    a_tokens = list(range(12))
    hashes = prompt_block_hashes(a_tokens, 4)
    run_and_free(manager, make_request("a", a_tokens))  # free queue: 3, 2, 1, 0
    manager.take_ops()
    run_and_free(manager, make_request("b", list(range(100, 112))))  # takes 3, 2, 1
    ops = manager.take_ops()
    # a's block 2 went to CPU block 0 and out again in the same step, for a's block 1: the
    # disk's copy comes from device block 2, before the step's swap-outs overwrite CPU block 0
    assert ops.swap_out == [(2, 0), (1, 0)]
    assert ops.to_disk == [DiskBlock(hashes[2], 2, a_tokens[8:12], on_device=True)]
    b_tokens = list(range(100, 112))
    run_and_free(manager, make_request("c", list(range(200, 212))))  # takes 0, 1, 2
    ops = manager.take_ops()
    b_hashes = prompt_block_hashes(b_tokens, 4)
    assert (
        ops.to_disk
        == [
            DiskBlock(hashes[1], 0, a_tokens[4:8]),  # cached a step ago: from the pool
            DiskBlock(hashes[0], 0, a_tokens[0:4], on_device=True),
            DiskBlock(b_hashes[2], 1, b_tokens[8:12], on_device=True),
        ]
    )
    assert list(manager.disk.on_disk) == [hashes[2], hashes[1], hashes[0], b_hashes[2]]
    manager.check_invariants()


def test_a_read_waits_then_serves_cpu_hits_and_a_failed_read_is_a_miss():
    manager = BlockManager(4, 4, True, num_cpu_blocks=2, enable_disk=True)
    manager.record_kv_events()
    tokens = list(range(13))  # 3 full blocks and the last token, which always computes
    hashes = prompt_block_hashes(tokens, 4)
    manager.disk.apply(StepOutput(step_id=1, disk_stored=hashes, disk_listed=True))
    assert manager.disk.listed
    request = make_request("a", tokens)
    assert manager.find_cached_prefix(request) == []
    assert manager.disk.start_load(request, 0)  # 3 blocks on disk, room in CPU for 2
    ops = manager.take_ops()
    assert ops.from_disk == [
        DiskBlock(hashes[0], 0, tokens[:4]),
        DiskBlock(hashes[1], 1, tokens[4:8]),
    ]
    manager.check_invariants()
    assert manager.disk.apply(StepOutput(step_id=2)) == []  # still reading
    ready = manager.disk.apply(
        StepOutput(step_id=3, disk_loaded=[hashes[0]], disk_failed=[hashes[1]])
    )
    assert ready == [request]
    assert manager.find_cached_prefix(request) == [CachedBlock(0, on_cpu=True)]
    assert not manager.disk.start_load(request, 1)  # one read an admission
    assert hashes[1] not in manager.disk.on_disk and manager.cpu.released == [1]
    events = manager.take_kv_events()
    assert events[:3] == [BlockStored(h, None, tier="disk") for h in hashes]
    assert events[3:] == [BlockRemoved(hashes[1], tier="disk")]
    manager.disk.admitted(request, 1)
    manager.check_invariants()
    manager.take_ops()
    assert sorted(manager.cpu.free) == [1]


def test_reads_never_evict_the_requests_own_cpu_hits():
    manager = BlockManager(4, 4, True, num_cpu_blocks=3, enable_disk=True)
    tokens = list(range(13))
    hashes = prompt_block_hashes(tokens, 4)
    other, another = b"x" * 32, b"y" * 32
    manager.cpu.cache(hashes[0], tuple(tokens[:4]), 0)  # the oldest: CPU block 0
    manager.cpu.cache(other, (1, 2, 3, 4), 1)
    manager.cpu.cache(another, (5, 6, 7, 8), 2)
    manager.take_ops()
    manager.disk.apply(StepOutput(step_id=1, disk_stored=hashes[1:], disk_listed=True))
    request = make_request("a", tokens)
    hits = manager.find_cached_prefix(request)
    assert hits == [CachedBlock(0, on_cpu=True)]
    assert manager.disk.start_load(request, 1)
    ops = manager.take_ops()
    # the two reads took the other entries' blocks (which went to disk), not block 0
    assert ops.from_disk == [
        DiskBlock(hashes[1], 1, tokens[4:8]),
        DiskBlock(hashes[2], 2, tokens[8:12]),
    ]
    assert ops.to_disk == [DiskBlock(other, 1, [1, 2, 3, 4]), DiskBlock(another, 2, [5, 6, 7, 8])]
    assert manager.find_cached_prefix(request) == hits
    manager.check_invariants()
