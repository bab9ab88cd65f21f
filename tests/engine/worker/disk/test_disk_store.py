"""The executor's disk tier on real files: the format's checks, its MAC and modes, LRU by
bytes, the listing at start and a rescan of a folder another store writes to."""

import hashlib
import hmac
import os
import shutil
import stat
import threading
import time
import zlib

import pytest
import torch
from blake3 import blake3
from kvpager.engine.worker.disk import store as store_module
from kvpager.engine.worker.disk.files import (
    HEADER,
    MAC_OFFSET,
    BlockLayout,
    ForgedBlockError,
    file_name,
    load_key,
    read_block,
    write_block,
)
from kvpager.engine.worker.disk.store import DiskStore
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.scheduler import StepOutput

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head_dim
LAYOUT = BlockLayout(SHAPE, torch.float32, hashlib.sha256(b"layout").digest())
FILE_BYTES = 116 + 8 * 4 + 2 * 2 * 4 * 8 * 4
KEY = hashlib.sha256(b"the test's key").digest()


def block_hash(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def cpu_cache(num_blocks: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (SHAPE[0], SHAPE[1], num_blocks, *SHAPE[2:])
    return torch.randn(shape, generator=generator)


def blocks(ids: range) -> list[DiskBlock]:
    return [DiskBlock(block_hash(i), i, [i, i + 1, i + 2, i + 3]) for i in ids]


def report(store: DiskStore) -> StepOutput:
    output = StepOutput(step_id=1)
    store.report(output, wait=True)
    return output


def test_a_file_reads_back_only_as_written(tmp_path):
    block = torch.randn(SHAPE)
    assert write_block(tmp_path, LAYOUT, KEY, block_hash(1), [1, 2, 3, 4], block) == FILE_BYTES
    assert torch.equal(read_block(tmp_path, LAYOUT, KEY, block_hash(1), [1, 2, 3, 4]), block)
    assert read_block(tmp_path, LAYOUT, KEY, block_hash(1), [1, 2, 3, 5]) is None  # tokens
    assert read_block(tmp_path, LAYOUT, KEY, block_hash(2), [1, 2, 3, 4]) is None  # no file
    other = BlockLayout(SHAPE, torch.float32, hashlib.sha256(b"other").digest())
    assert read_block(tmp_path, other, KEY, block_hash(1), [1, 2, 3, 4]) is None
    path = tmp_path / file_name(block_hash(1))
    data = bytearray(path.read_bytes())
    data[130] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ForgedBlockError):  # one flipped bit
        read_block(tmp_path, LAYOUT, KEY, block_hash(1), [1, 2, 3, 4])
    path.write_bytes(bytes(data[:50]))
    assert read_block(tmp_path, LAYOUT, KEY, block_hash(1), [1, 2, 3, 4]) is None  # torn


def forge(path, payload: bytes, key: bytes | str) -> None:
    """Replace a file's K/V with `payload` and recompute its check as a forger can: the CRC-32
    version 1 had, a plain hash ("crc32", "sha256"), an HMAC-SHA256 as version 2 had or a
    keyed BLAKE3 as version 3 has, under a key of their own (("hmac", key) or key). ("hmac",
    KEY) is a version-2 tag under the store's own key: the format's MAC is BLAKE3 only."""
    data = bytearray(path.read_bytes())
    data[len(data) - len(payload) :] = payload
    data[MAC_OFFSET : HEADER.size] = bytes(32)
    if key == "crc32":
        tag = zlib.crc32(data[HEADER.size :]).to_bytes(4, "little").ljust(32, b"\0")
    elif key == "sha256":
        tag = hashlib.sha256(bytes(data)).digest()
    elif isinstance(key, tuple):
        tag = hmac.new(key[1], bytes(data), hashlib.sha256).digest()
    else:
        tag = blake3(bytes(data), key=key).digest()
    data[MAC_OFFSET : HEADER.size] = tag
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "forger_key", ["crc32", "sha256", ("hmac", b"k" * 32), ("hmac", KEY), b"k" * 32]
)
def test_a_forged_file_with_a_recomputed_check_is_dropped_and_counted(tmp_path, forger_key):
    cache = cpu_cache(2)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    report(store)
    store.save(blocks(range(2)), cache, cache)
    store.flush()
    path = store.folder / file_name(block_hash(0))
    forge(path, cache[:, :, 1].contiguous().numpy().tobytes(), forger_key)  # block 1's K/V
    target = torch.zeros_like(cache)
    store.load(blocks(range(2)), target)
    output = report(store)
    assert output.disk_failed == [block_hash(0)] and output.disk_loaded == [block_hash(1)]
    assert output.disk_rejected == 1 and block_hash(0) in output.disk_removed
    assert not target[:, :, 0].any()  # never served
    assert not path.exists() and block_hash(0) not in store.index  # dropped
    assert report(store).disk_rejected == 0  # counted once
    store.close()


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_folders_files_and_key_are_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        key = load_key(tmp_path / "keys" / "kv-disk.key")
        store = DiskStore(tmp_path / "kv", 1 << 20, LAYOUT, key)
        cache = cpu_cache(2)
        store.save(blocks(range(2)), cache, cache)
        store.flush()
        store.close()
    finally:
        os.umask(old)
    assert load_key(tmp_path / "keys" / "kv-disk.key") == key and len(key) == 32  # kept
    files = [tmp_path / "keys" / "kv-disk.key", *store.folder.iterdir()]
    assert len(files) == 3
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in (tmp_path / "keys", tmp_path / "kv", store.folder):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_key_others_can_read_is_refused(tmp_path):
    path = tmp_path / "kv-disk.key"
    load_key(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0600"):
        load_key(path)


def test_saved_blocks_load_into_other_cpu_blocks_and_keep_within_the_bound(tmp_path):
    cache = cpu_cache(6)
    store = DiskStore(tmp_path, 4 * FILE_BYTES, LAYOUT, KEY)
    assert report(store).disk_listed  # an empty listing, sent at once
    store.save(blocks(range(6)), cache, cache)
    store.flush()
    assert sorted(store.index) == sorted(block_hash(i) for i in range(2, 6))  # oldest went
    assert store.num_bytes == 4 * FILE_BYTES
    assert set(report(store).disk_removed) == {block_hash(0), block_hash(1)}
    target = torch.zeros_like(cache)
    wanted = [DiskBlock(block_hash(i), 5 - i, [i, i + 1, i + 2, i + 3]) for i in (1, 2, 5)]
    store.load(wanted, target)
    output = report(store)
    assert output.disk_loaded == [block_hash(2), block_hash(5)]
    assert output.disk_failed == [block_hash(1)]
    assert torch.equal(target[:, :, 3], cache[:, :, 2])
    assert torch.equal(target[:, :, 0], cache[:, :, 5])
    assert not target[:, :, 4].any()  # the miss wrote nothing
    store.close()


def test_a_restart_lists_the_folder(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    store.save(blocks(range(3)), cpu_cache(3), cpu_cache(1))
    store.close()
    again = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    output = report(again)
    assert set(output.disk_stored) == {block_hash(i) for i in range(3)} and output.disk_listed
    assert not report(again).disk_stored  # once
    again.reset()  # a new scheduler hears it all again
    assert len(report(again).disk_stored) == 3
    again.close()


def test_stores_sharing_a_folder_see_each_others_files(tmp_path):
    first, second = (
        DiskStore(tmp_path, 1 << 20, LAYOUT, KEY),
        DiskStore(tmp_path, 1 << 20, LAYOUT, KEY),
    )
    report(second)
    cache = cpu_cache(2)
    first.save(blocks(range(2)), cache, cache)
    first.flush()
    second.rescan()
    assert set(report(second).disk_stored) == {block_hash(0), block_hash(1)}
    (first.folder / file_name(block_hash(0))).unlink()  # the first's eviction, say
    target = torch.zeros_like(cache)
    second.load(blocks(range(2)), target)
    output = report(second)
    assert output.disk_failed == [block_hash(0)] and output.disk_loaded == [block_hash(1)]
    assert block_hash(0) in output.disk_removed
    assert torch.equal(target[:, :, 1], cache[:, :, 1])
    first.close()
    second.close()


def test_the_writer_outlives_its_folder_and_nothing_waits_without_end(tmp_path, monkeypatch):
    """A folder removed under the store (a cleanup job): the idle listing fails, the writer
    stays up, and later blocks fail as removed. A read stuck in the kernel makes a reset
    fail loudly at its bound, not hang the executor."""
    monkeypatch.setattr(store_module, "RESCAN_S", 0.05)
    store = DiskStore(tmp_path, 1 << 20, LAYOUT, KEY)
    report(store)
    shutil.rmtree(store.folder)
    time.sleep(0.3)  # several idle listings of a folder that is gone
    cache = cpu_cache(2)
    store.save(blocks(range(2)), cache, cache)
    store.flush()  # a dead writer would leave this waiting forever
    assert set(report(store).disk_removed) >= {block_hash(0), block_hash(1)}
    monkeypatch.setattr(store_module, "DRAIN_WAIT_S", 0.2)
    go, read_block = threading.Event(), store._read_block
    store._read_block = lambda *args: go.wait(30.0) and read_block(*args)
    store.load(blocks(range(1)), torch.zeros_like(cache))
    with pytest.raises(TimeoutError, match="1 reads unfinished"):
        store.reset()
    go.set()
    store.close()


def test_the_readers_and_the_writer_start_no_openmp_team(tmp_path):
    """Their copies of blocks above torch's grain size stay on their own threads, as
    kernels/openmp.py wants: the OS threads the store added are its own Python threads."""
    shape = (2, 2, 4, 8, 512)  # 65,536 values a block
    layout = BlockLayout(shape, torch.float32, hashlib.sha256(b"wide layout").digest())
    cache = torch.randn((shape[0], shape[1], 4, *shape[2:]))
    torch.zeros_like(cache).copy_(cache)  # this thread's own team first, if it has one
    before = len(os.listdir("/proc/self/task"))
    store = DiskStore(tmp_path, 1 << 30, layout, KEY)
    store.save(blocks(range(4)), cache, cache)
    target = torch.zeros_like(cache)
    store.load(blocks(range(2)), target)  # perhaps from the snapshots still pending
    report(store)
    store.flush()
    store.load(blocks(range(2, 4)), target)  # from the files
    assert report(store).disk_loaded == [block_hash(2), block_hash(3)]
    assert torch.equal(target, cache)
    own = sum(t.name.startswith("kvpager-disk") for t in threading.enumerate())
    assert len(os.listdir("/proc/self/task")) - before == own
    store.close()
