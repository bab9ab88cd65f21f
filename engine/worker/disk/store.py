"""DiskStore: the executor's disk tier under its CPU pool, off the step path.

    step N:  save(blocks_to_disk)    snapshot the CPU blocks (one index_select) before the
                                     step's swap-outs reuse them; a writer thread writes them
             swap-outs, swap-ins, copies
             load(blocks_from_disk)  reader threads fill the reserved CPU blocks
             forward pass
             report(output)          the reads finished so far (all of them, bounded, when the
                                     step computed nothing), and what the listing found

A read of a block still waiting to be written is served from its snapshot. The writer keeps
the folder within `capacity_bytes`, least recently used first (a read refreshes a file's mtime,
so the order survives a restart), and rescans the folder when idle: files of other instances
sharing it are reported as found, files gone are reported as removed. A file failing its MAC
(files.py) is deleted, reported as removed and counted (`disk_rejected`), never served.
Only block hashes leave this module; the scheduler turns them into its accounting
(engine/kv/disk_index.py).
"""

import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import structlog
import torch
from kvpager.engine.config import ExecutorConfig
from kvpager.engine.paths import kv_disk_key_file
from kvpager.engine.worker.disk.files import (
    HEADER,
    BlockLayout,
    ForgedBlockError,
    block_layout,
    file_name,
    hash_of,
    load_key,
    private_dir,
    read_open_block,
    write_block,
)
from kvpager.kernels import openmp
from kvpager.kernels.cpu_block_ops import copy_block_in
from kvpager.schemas.errors import ConfigError
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.scheduler import StepOutput

log = structlog.get_logger(__name__)

RESCAN_S = 5.0  # an idle writer lists the folder this often (other instances' files)
MAX_LISTED_PER_STEP = 8192  # hashes a step output carries (~300 kB)
LOAD_WAIT_S = 5.0  # an idle step waits at most this long for reads in flight
# a reset, flush or close waits at most this long for the threads: a read or write stuck in
# the kernel (a hung network file system) fails loudly instead of hanging the executor
DRAIN_WAIT_S = 120.0
# reader threads: a read is bound by its HMAC (~1 GB/s a core), which hashlib computes
# without the GIL, so a step's reads split over several threads go at several cores' pace
NUM_READERS = max(1, min(4, os.cpu_count() or 1))
# snapshots waiting for the writer; past this (a slow disk), new blocks are not kept
MAX_PENDING_BYTES = 1 << 30


def open_disk(
    config: ExecutorConfig,
    cpu_cache: torch.Tensor,
    kv_dtype: torch.dtype,
    rank: int,
    size: int,
    windows: tuple[int, ...] = (),
    kv_layout: str = "token-major",
) -> "DiskStore | None":
    """The disk tier under the CPU pool, if configured (it reads back through the pool).
    kv_layout: the order of values inside a block (kernels/backend.py), part of the files'
    identity: a folder written in one layout is never read in another."""
    if config.kv_disk_dir is None:
        return None
    if any(windows):  # its files hold every layer of a block: one full-attention group
        raise ConfigError("kv_disk_dir: the disk tier serves full-attention models only")
    if cpu_cache.shape[2] == 0:
        raise ConfigError("kv_disk_dir: the disk tier needs a CPU pool (set swap_space)")
    shape = list(cpu_cache.shape)
    del shape[2]  # one block: [layers, 2, block_size, kv_heads, head_dim]
    layout = block_layout(config.model_path, tuple(shape), kv_dtype, rank, size, kv_layout)
    key = load_key(Path(config.kv_disk_key_file or kv_disk_key_file()))
    return DiskStore(Path(config.kv_disk_dir), config.kv_disk_bytes, layout, key)


class DiskStore:
    def __init__(self, root: Path, capacity_bytes: int, layout: BlockLayout, key: bytes) -> None:
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.key = key  # the files' MAC key (files.load_key)
        self.folder = Path(root) / layout.folder_name
        try:
            private_dir(Path(root))
            self.folder.mkdir(mode=0o700, exist_ok=True)
            self.folder.chmod(0o700)  # its files name prefixes: other users see none
        except OSError as exc:
            raise ConfigError(f"kv_disk_dir: cannot create {self.folder}: {exc}") from None
        self.num_rejected = 0  # files that failed their MAC, deleted (reported, then reset)
        self._lock = threading.Lock()  # index, pending, reports
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self.num_bytes = 0
        self._pending: dict[bytes, torch.Tensor] = {}  # snapshots not yet on disk
        self._found: list[bytes] = []  # to report as stored (listing, others' files)
        self._removed: list[bytes] = []
        self._listed = False
        self._loads: list[Future] = []
        self._reader = openmp.serial_pool(NUM_READERS, "kvpager-disk-read")
        self._buffers = threading.local()  # each reader's file buffer, reused
        self._dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)  # reads open in it
        self._writes: queue.Queue = queue.Queue()
        self.rescan()
        self._report_all()
        self._writer = threading.Thread(target=self._write_loop, name="kvpager-disk-write")
        self._writer.daemon = True
        self._writer.start()

    # --- the step's side ----------------------------------------------------------------

    def save(
        self, blocks: list[DiskBlock], cpu_cache: torch.Tensor, kv_cache: torch.Tensor
    ) -> None:
        """Snapshot the blocks' bytes now (a memcpy: from the CPU pool, or from the device
        for blocks that reach the pool in this step); the writer thread writes them later."""
        if not blocks:
            return
        with self._lock:
            backlog = len(self._pending) * self.layout.num_bytes
            if backlog > MAX_PENDING_BYTES:  # the disk is behind: these are not kept
                self._removed += [block.block_hash for block in blocks]
                return
        snapshot = torch.empty(
            (*cpu_cache.shape[:2], len(blocks), *cpu_cache.shape[3:]), dtype=cpu_cache.dtype
        )  # [layers, 2, n, bs, kvh, d]
        for on_device, cache in ((False, cpu_cache), (True, kv_cache)):
            rows = [i for i, b in enumerate(blocks) if b.on_device == on_device]
            if len(rows) == len(blocks) and cache.device.type == "cpu":
                ids = torch.tensor([block.block_id for block in blocks])
                torch.index_select(cache, 2, ids, out=snapshot)  # all from here: one gather
            elif rows:
                ids = torch.tensor([blocks[i].block_id for i in rows], device=cache.device)
                snapshot[:, :, rows] = torch.index_select(cache, 2, ids).cpu()
        with self._lock:
            for i, block in enumerate(blocks):
                self._pending[block.block_hash] = snapshot[:, :, i]
        self._writes.put((blocks, snapshot))

    def load(self, blocks: list[DiskBlock], cpu_cache: torch.Tensor) -> None:
        """Start reading the blocks into their CPU blocks (reported once done), split over
        the reader threads in runs of consecutive blocks."""
        num_parts = min(NUM_READERS, len(blocks))
        for part in range(num_parts):
            start, end = part * len(blocks) // num_parts, (part + 1) * len(blocks) // num_parts
            self._loads.append(self._reader.submit(self._read_all, blocks[start:end], cpu_cache))

    def report(self, output: StepOutput, wait: bool) -> None:
        """Put the finished reads and the listing's news into the step's output."""
        if wait and self._loads:  # nothing else to do this step: let the reads finish first
            futures.wait(self._loads, timeout=LOAD_WAIT_S)
        done = [f for f in self._loads if f.done()]
        self._loads = [f for f in self._loads if not f.done()]
        for future in done:
            loaded, failed = future.result()
            output.disk_loaded += loaded
            output.disk_failed += failed
        with self._lock:
            output.disk_stored = self._found[:MAX_LISTED_PER_STEP]
            self._found = self._found[MAX_LISTED_PER_STEP:]
            output.disk_removed, self._removed = self._removed, []
            output.disk_rejected, self.num_rejected = self.num_rejected, 0
            if self._listed and not self._found:  # the last chunk of the listing
                output.disk_listed, self._listed = True, False

    def reset(self) -> None:
        """A new scheduler: finish the reads in flight (their blocks are its free blocks now)
        and tell it everything on disk again."""
        _, stuck = futures.wait(self._loads, timeout=DRAIN_WAIT_S)
        if stuck:  # they would write into blocks the new scheduler hands out
            raise TimeoutError(f"disk tier: {len(stuck)} reads unfinished after {DRAIN_WAIT_S} s")
        self._loads = []
        with self._lock:
            self._removed = []
            self._report_all()

    def flush(self) -> None:
        """Wait until every block saved so far is on disk (or failed)."""
        deadline = time.monotonic() + DRAIN_WAIT_S
        with self._writes.all_tasks_done:  # Queue.join's own wait, with a bound
            while self._writes.unfinished_tasks:
                if not self._writer.is_alive() or time.monotonic() > deadline:
                    raise TimeoutError("disk tier: the writer stopped with blocks unwritten")
                self._writes.all_tasks_done.wait(0.1)

    def close(self) -> None:
        """Finish the writes queued so far, then stop; threads still stuck are left behind
        (daemons, with a warning), never waited for without end."""
        self._writes.put(None)
        self._writer.join(timeout=DRAIN_WAIT_S)
        _, stuck = futures.wait(self._loads, timeout=DRAIN_WAIT_S)
        if stuck or self._writer.is_alive():
            log.warning("disk tier closed with threads stuck", num_reads=len(stuck))
        self._reader.shutdown(wait=not stuck, cancel_futures=True)
        os.close(self._dir_fd)

    # --- reads (the reader thread) --------------------------------------------------------

    def _read_all(self, blocks: list[DiskBlock], cpu_cache: torch.Tensor):
        """One reader thread's part: every file opened (and announced to the kernel) first,
        then each read straight into its CPU block."""
        rows = _block_rows(cpu_cache)
        fds = [self._open(block) for block in blocks]
        loaded, failed = [], []
        try:
            for idx, block in enumerate(blocks):
                if fds[idx] is None:  # perhaps written since: one more try
                    fds[idx] = self._open(block, advise=False)
                ok = self._read(block, fds[idx], cpu_cache, rows)
                (loaded if ok else failed).append(block.block_hash)
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        return loaded, failed

    def _open(self, block: DiskBlock, advise: bool = True) -> int | None:
        """The block's file, open, or None (a miss, or a block only its snapshot holds yet).
        `advise`: ask the kernel to read it ahead now (POSIX_FADV_WILLNEED), so a cold disk has
        the whole part queued, not one file at a time behind each MAC."""
        try:
            fd = os.open(file_name(block.block_hash), os.O_RDONLY, dir_fd=self._dir_fd)
        except OSError:
            return None
        if advise and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # a file system without readahead hints
        return fd

    def _read(self, block: DiskBlock, fd: int | None, cache: torch.Tensor, rows) -> bool:
        try:
            return self._read_block(block, fd, cache, rows)
        except Exception:  # whatever the file held, a miss: never a failed step
            log.exception("disk tier read failed", block_hash=block.block_hash.hex())
            return False

    def _read_block(self, block: DiskBlock, fd: int | None, cache: torch.Tensor, rows) -> bool:
        """Fill CPU block `block.block_id`: from the snapshot of a block not yet written, else
        from its open file `fd` (read whole into this thread's buffer, checked, copied in)."""
        with self._lock:
            pending = self._pending.get(block.block_hash)
        if pending is not None:
            copy_block_in(pending, cache, block.block_id)
            return True
        ok = False
        try:
            ok = fd is not None and self._read_file(block, fd, cache, rows)
        except ForgedBlockError:
            log.warning("disk tier file failed its MAC: deleted", block_hash=block.block_hash.hex())
            _unlink(self.folder / file_name(block.block_hash))
            with self._lock:
                self.num_rejected += 1
        with self._lock:
            if not ok:
                self._forget(block.block_hash)
            elif block.block_hash in self.index:
                self.index.move_to_end(block.block_hash)
        if ok:
            _touch(fd)  # the LRU order, kept in mtimes across restarts
        return ok

    def _read_file(self, block: DiskBlock, fd: int, cache: torch.Tensor, rows) -> bool:
        content = read_open_block(
            fd, self.layout, self.key, block.block_hash, block.token_ids,
            self._buffer(len(block.token_ids)),
        )  # fmt: skip
        if content is None:
            return False
        if rows is None:
            copy_block_in(content, cache, block.block_id)
        else:  # a numpy copy: no per-call setup, and no GIL held while it runs
            rows[:, block.block_id] = content.view(torch.uint8).numpy().reshape(len(rows), -1)
        return True

    def _buffer(self, num_tokens: int) -> bytearray:
        """This reader thread's file buffer (allocated once: every file has one size)."""
        size = HEADER.size + 8 * num_tokens + self.layout.num_bytes
        buffer = getattr(self._buffers, "data", None)
        if buffer is None or len(buffer) < size:
            buffer = self._buffers.data = bytearray(size)
        return buffer

    # --- writes and listing (the writer thread) ---------------------------------------------

    def _write_loop(self) -> None:
        openmp.serial_here()  # its copies stay on this thread (kernels/openmp.py)
        last_scan = time.monotonic()
        while True:
            try:
                item = self._writes.get(timeout=RESCAN_S)
            except queue.Empty:
                item = ()
            if item is None:
                self._writes.task_done()
                return
            if item:
                try:
                    self._write_batch(*item)
                finally:
                    self._writes.task_done()
            if time.monotonic() - last_scan >= RESCAN_S and self._writes.empty():
                try:
                    self.rescan()
                except OSError as exc:  # the folder gone: the writer stays up for the writes
                    log.warning("disk tier listing failed", error=str(exc))
                last_scan = time.monotonic()

    def _write_batch(self, blocks: list[DiskBlock], snapshot: torch.Tensor) -> None:
        for i, block in enumerate(blocks):
            try:
                size = write_block(
                    self.folder, self.layout, self.key, block.block_hash, block.token_ids,
                    snapshot[:, :, i].contiguous(),
                )  # fmt: skip
            except Exception as exc:  # disk full, folder removed: the block is not kept
                log.warning("disk tier write failed", error=str(exc))
                size = None
            with self._lock:
                self._pending.pop(block.block_hash, None)
                if size is None:
                    self._removed.append(block.block_hash)
                else:
                    self._add(block.block_hash, size)
                    self._evict_over_capacity()

    def rescan(self) -> None:
        """Match the index to the folder: files that appeared (other instances) are found,
        files that vanished are removed. Oldest mtime first, as least recently used."""
        entries = []
        with os.scandir(self.folder) as listing:
            for entry in listing:
                block_hash = hash_of(entry.name)
                if block_hash is not None:
                    try:
                        stat = entry.stat()
                    except OSError:
                        continue
                    entries.append((stat.st_mtime_ns, block_hash, stat.st_size))
        entries.sort()
        present = {block_hash for _, block_hash, _ in entries}
        with self._lock:
            for block_hash in [h for h in self.index if h not in present]:
                self._forget(block_hash)
            for _, block_hash, size in entries:
                if block_hash not in self.index:
                    self._add(block_hash, size)
                    self._found.append(block_hash)
            self._evict_over_capacity()

    # --- the index (under the lock) ---------------------------------------------------------

    def _report_all(self) -> None:
        self._found = list(self.index)
        self._listed = True

    def _add(self, block_hash: bytes, size: int) -> None:
        if block_hash in self.index:
            self.num_bytes -= self.index[block_hash]
        self.index[block_hash] = size
        self.index.move_to_end(block_hash)
        self.num_bytes += size

    def _forget(self, block_hash: bytes) -> None:
        size = self.index.pop(block_hash, None)
        if size is not None:
            self.num_bytes -= size
        self._removed.append(block_hash)

    def _evict_over_capacity(self) -> None:
        while self.num_bytes > self.capacity_bytes and self.index:
            block_hash = next(iter(self.index))
            _unlink(self.folder / file_name(block_hash))
            self._forget(block_hash)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone (a sharing instance evicted it)


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:
        pass


def _block_rows(cache: torch.Tensor):
    """The cache as [layers * 2, blocks, block bytes] numpy bytes, whose [:, block_id] rows a
    file's payload fills in order; None for a cache that is not a contiguous host tensor."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    num_rows = cache.shape[0] * cache.shape[1]
    return cache.view(torch.uint8).view(num_rows, cache.shape[2], -1).numpy()
