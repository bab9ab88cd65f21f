"""A step's disk reads split over the reader threads, into reused buffers, land byte for byte
as one-file-at-a-time reads (files.read_block) do, misses included."""

import os
import threading

import pytest
import torch
from kvpager.engine.worker.disk import store as store_module
from kvpager.engine.worker.disk.files import read_block
from kvpager.engine.worker.disk.store import DiskStore
from kvpager.schemas.executor import DiskBlock

from tests.engine.worker.disk.test_disk_store import KEY, LAYOUT, block_hash, blocks, cpu_cache
from tests.engine.worker.disk.test_disk_store import report as step_report


def test_reads_over_several_threads_equal_reads_one_block_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "NUM_READERS", 3)  # whatever the host's cores
    cache = cpu_cache(12, seed=3)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    step_report(store)
    store.save(blocks(range(11)), cache, cache)
    store.flush()
    # into other CPU blocks, scattered, with block 4's file gone: a miss among hits
    (store.folder / f"{block_hash(4).hex()}.kvb").unlink()
    wanted = [DiskBlock(block_hash(i), 11 - i, [i, i + 1, i + 2, i + 3]) for i in range(11)]
    batched = torch.zeros_like(cache)
    store.load(wanted, batched)
    assert len(store._loads) == 3  # one read job a thread
    output = step_report(store)
    one_by_one = torch.zeros_like(cache)
    for block in wanted:
        content = read_block(store.folder, LAYOUT, KEY, block.block_hash, block.token_ids)
        if content is not None:
            one_by_one[:, :, block.block_id] = content
    assert torch.equal(batched.view(torch.uint8), one_by_one.view(torch.uint8))
    assert output.disk_loaded == [block_hash(i) for i in range(11) if i != 4]  # in order
    assert output.disk_failed == [block_hash(4)]
    for i in range(11):
        if i != 4:
            assert torch.equal(batched[:, :, 11 - i], cache[:, :, i])
    assert not batched[:, :, 7].any()  # the miss wrote nothing
    store.close()


def test_a_reused_buffer_never_leaks_one_file_into_the_next(tmp_path):
    cache = cpu_cache(2, seed=4)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    store.save(blocks(range(2)), cache, cache)
    store.flush()
    buffer = bytearray(4096)
    first = read_block(store.folder, LAYOUT, KEY, block_hash(0), [0, 1, 2, 3], buffer).clone()
    second = read_block(store.folder, LAYOUT, KEY, block_hash(1), [1, 2, 3, 4], buffer)
    assert torch.equal(first, cache[:, :, 0]) and torch.equal(second, cache[:, :, 1])
    assert read_block(store.folder, LAYOUT, KEY, block_hash(0), [0, 1, 2, 5], buffer) is None
    store.close()


def test_a_block_still_waiting_for_its_write_reads_from_its_snapshot(tmp_path, monkeypatch):
    """The writer held: the reads come from the step's snapshot (a strided slice of it), byte
    for byte, and the files are written once the writer goes on."""
    release = threading.Event()
    write = store_module.write_block

    def held_write(*args, **kwargs):
        release.wait(timeout=30)
        return write(*args, **kwargs)

    monkeypatch.setattr(store_module, "write_block", held_write)
    cache = cpu_cache(4, seed=5)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    step_report(store)
    store.save(blocks(range(3)), cache, cache)
    target = torch.zeros_like(cache)
    store.load(
        [DiskBlock(block_hash(i), 3 - i, [i, i + 1, i + 2, i + 3]) for i in range(3)], target
    )
    output = step_report(store)
    assert output.disk_loaded == [block_hash(i) for i in range(3)] and not output.disk_failed
    for i in range(3):
        assert torch.equal(target[:, :, 3 - i].view(torch.uint8), cache[:, :, i].view(torch.uint8))
    assert not any(store.folder.iterdir())  # nothing written yet: all from the snapshot
    release.set()
    store.flush()
    assert len(list(store.folder.iterdir())) == 3
    store.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds through /proc")
def test_a_read_opens_each_file_once_closes_it_and_writes_nothing_for_a_miss(tmp_path, monkeypatch):
    """Each file is opened once (the readahead advice and the read share it) and closed
    whatever the read found; a torn file and a missing one fail without touching their CPU
    blocks; a file read refreshes its mtime (the LRU order a restart lists)."""
    cache = cpu_cache(6, seed=6)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    step_report(store)
    store.save(blocks(range(6)), cache, cache)
    store.flush()
    path = {i: store.folder / f"{block_hash(i).hex()}.kvb" for i in range(6)}
    os.truncate(path[2], path[2].stat().st_size - 1)  # torn
    path[4].unlink()  # gone
    os.utime(path[0], ns=(10**9, 10**9))
    before, opened, real_open = _open_fds(), [], os.open

    def counted_open(name, *args, **kwargs):
        opened.append(os.fspath(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", counted_open)
    target = torch.zeros_like(cache)
    store.load(blocks(range(6)), target)
    output = step_report(store)
    monkeypatch.undo()
    for i in (0, 1, 2, 3, 5):  # the advice and the read share one open
        assert sum(name.endswith(path[i].name) for name in opened) == 1
    assert output.disk_loaded == [block_hash(i) for i in (0, 1, 3, 5)]
    assert output.disk_failed == [block_hash(2), block_hash(4)]
    assert _open_fds() == before  # every file closed, hits and misses alike
    for i in (0, 1, 3, 5):
        assert torch.equal(target[:, :, i].view(torch.uint8), cache[:, :, i].view(torch.uint8))
    assert not target[:, :, 2].any() and not target[:, :, 4].any()
    assert path[0].stat().st_mtime_ns > 10**9  # touched by the read
    store.close()
