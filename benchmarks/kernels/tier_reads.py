"""What the KV tiers read back at, beside what the host copies and reads, in one run.

A returning conversation's blocks come back from the CPU pool (a swap-in: the backend's
`swap_blocks`, as the executor runs it) and from disk (DiskStore's reader threads into the CPU
pool, then the swap-in). Each is timed over the same bytes as a plain `memcpy` (a torch copy of
one contiguous buffer) and a plain read of the same files (and of one file of the same total
size), so the tiers' rates read as a fraction of what the host allows; the files' MAC (keyed
BLAKE3; HMAC-SHA256 before format version 3) is timed alone too, as reads are bound by it.
SmolLM2-135M's block layout (30 layers, 3 KV heads, head_dim 64, 16-token blocks: 368 KiB a
block in bf16, 736 KiB in fp32), both dtypes by default; the device pool is CUDA's when there is
one, else host memory as on a CPU host. Disk reads are timed twice: from the page cache
(`warm`), and `cold`, the files evicted before each read (os.sync, then POSIX_FADV_DONTNEED on
each file: the page cache of a regular file system drops them; the table says when the host
cannot). Nothing else should run meanwhile.

    python -m benchmarks.kernels.tier_reads [--blocks 1024] [--dtype bf16 fp32] [--dir /var/tmp]
                                             [--smoke]
"""

import argparse
import hashlib
import hmac
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from blake3 import blake3
from kvpager.engine.worker.disk.files import BlockLayout, file_name
from kvpager.engine.worker.disk.store import NUM_READERS, DiskStore
from kvpager.kernels.backend import default_backend_name, get_kernel_ops
from kvpager.kernels.isa import isa_flags
from kvpager.kernels.reference import swap_blocks_ref
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.scheduler import StepOutput

from benchmarks.kernels.cpu_kernels import BLOCK, HEAD_DIM, KV_HEADS, LAYERS

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLD_ADVICE = hasattr(os, "posix_fadvise")


def lscpu_flags() -> str:
    """lscpu's model name and flags line (the host these numbers come from)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu: unavailable"
    keep = ("Model name", "CPU(s)", "Flags")
    return "\n".join(line for line in text.splitlines() if line.startswith(keep))


def best_s(fn, repeats: int, before=None) -> float:
    """The best of `repeats` timed calls after a warm one; `before` runs untimed before each."""
    fn()  # warm: allocations, page faults
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def caches(
    num_blocks: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CPU pool, device pool), both [layers, 2, blocks, block_size, kv heads, head_dim]."""
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    cpu = torch.randn(shape).to(dtype)
    if device.type == "cuda":
        cpu = cpu.pin_memory()
    return cpu, torch.zeros(shape, dtype=dtype, device=device)


def mappings(num_blocks: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """CPU -> device pairs: consecutive blocks (allocated together) and scattered ones."""
    ids = list(range(num_blocks))
    shuffled = random.Random(seed).sample(ids, num_blocks)
    return {
        "consecutive": torch.tensor([ids, ids]).T.contiguous(),
        "scattered": torch.tensor([shuffled, ids]).T.contiguous(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_tier_rows(cpu, dev, repeats: int) -> list[tuple[str, float]]:
    device = dev.device
    swap = get_kernel_ops(default_backend_name(device)).swap_blocks
    rows = []
    for name, mapping in mappings(cpu.shape[2]).items():
        for label, fn in (
            (f"backend ({default_backend_name(device)})", swap),
            ("twin", swap_blocks_ref),
        ):

            def run(fn=fn, mapping=mapping) -> None:
                fn(cpu, dev, mapping)
                sync(device)

            rows.append((f"CPU pool -> device pool, {name} blocks, {label}", best_s(run, repeats)))
    flat_src = cpu.view(-1)
    flat_dst = torch.empty_like(flat_src, device=device)

    def memcpy() -> None:
        flat_dst.copy_(flat_src)
        sync(device)

    rows.append(("memcpy: one torch copy of the same bytes", best_s(memcpy, repeats)))
    return rows


def mac_rows(cpu: torch.Tensor, repeats: int) -> list[tuple[str, float]]:
    """The files' MAC alone over the same bytes, one thread, a block at a time."""
    key = hashlib.sha256(b"mac").digest()
    blocks = [memoryview(b.contiguous().view(torch.uint8).numpy()) for b in cpu.unbind(2)]

    def keyed_blake3() -> None:
        for block in blocks:
            blake3(block, key=key).digest()

    def hmac_sha256() -> None:
        for block in blocks:
            hmac.new(key, block, hashlib.sha256).digest()

    return [
        ("MAC alone: keyed BLAKE3 (format 3), one thread", best_s(keyed_blake3, repeats)),
        ("MAC alone: HMAC-SHA256 (format 2), one thread", best_s(hmac_sha256, repeats)),
    ]


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (clean pages only: written back first)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def written_store(cpu: torch.Tensor, folder: Path) -> tuple[DiskStore, list[DiskBlock]]:
    """A DiskStore in `folder` holding every block of `cpu`, on disk."""
    layout = BlockLayout(
        (LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), cpu.dtype, hashlib.sha256(b"bench").digest()
    )
    store = DiskStore(folder, 1 << 40, layout, hashlib.sha256(b"tier reads").digest())
    blocks = [
        DiskBlock(hashlib.sha256(i.to_bytes(4, "little")).digest(), i, list(range(BLOCK)))
        for i in range(cpu.shape[2])
    ]
    store.save(blocks, cpu, cpu)
    store.flush()
    return store, blocks


def disk_rows(cpu, dev, folder: Path, repeats: int) -> list[tuple[str, float]]:
    store, blocks = written_store(cpu, folder)
    target = torch.zeros_like(cpu)

    def disk_to_cpu() -> None:
        store.load(blocks, target)
        output = StepOutput(step_id=0)
        store.report(output, wait=True)
        assert len(output.disk_loaded) == len(blocks), "a read failed"

    swap = get_kernel_ops(default_backend_name(dev.device)).swap_blocks
    mapping = mappings(len(blocks))["consecutive"]

    def disk_to_device() -> None:
        disk_to_cpu()
        swap(target, dev, mapping)
        sync(dev.device)

    files = [store.folder / file_name(block.block_hash) for block in blocks]
    buffer = bytearray(os.path.getsize(files[0]))

    def plain_reads() -> None:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buffer)

    big = store.folder.parent / "one-file.bin"
    with open(big, "wb") as f:
        f.write(memoryview(cpu.view(torch.uint8).numpy()).cast("B"))
    big_buffer = bytearray(big.stat().st_size)

    def one_file() -> None:
        with open(big, "rb", buffering=0) as f:
            f.readinto(big_buffer)

    paths = {
        f"disk -> CPU pool ({NUM_READERS} reader threads, MAC checked)": (disk_to_cpu, files),
        "disk -> CPU pool -> device pool (the engine's path)": (disk_to_device, files),
        "plain read of the same files, one thread": (plain_reads, files),
        "plain read of one file of the same bytes": (one_file, [big]),
    }
    rows = []
    for cold in (False, True) if COLD_ADVICE else (False,):
        for name, (fn, evicted) in paths.items():
            before = (lambda evicted=evicted: evict(evicted)) if cold else None
            rows.append((f"{name}, {'cold' if cold else 'warm'}", best_s(fn, repeats, before)))
    store.close()
    assert torch.equal(target.view(torch.uint8), cpu.view(torch.uint8)), "blocks read differ"
    return rows


def dtype_rows(args, dtype: torch.dtype, device: torch.device) -> tuple[int, list]:
    """(bytes moved, rows) of one dtype."""
    cpu, dev = caches(args.blocks, device, dtype)
    root = Path(tempfile.mkdtemp(prefix="tier-reads-", dir=args.dir))
    try:
        rows = cpu_tier_rows(cpu, dev, args.repeats) + mac_rows(cpu, args.repeats)
        rows += disk_rows(cpu, dev, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return cpu.numel() * cpu.element_size(), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved (368 KiB each)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--dir", type=Path, help="folder for the files (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="16 blocks, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(lscpu_flags())
    print(f"ISA: {' '.join(isa_flags())}; {args.threads} threads; device pool on {device}")
    if not COLD_ADVICE:
        print("no posix_fadvise here: every disk row reads from the page cache (warm)")
    for dtype_name in args.dtype:
        num_bytes, rows = dtype_rows(args, DTYPES[dtype_name], device)
        print(f"\n{dtype_name}: {args.blocks} blocks, {num_bytes / 1e6:.0f} MB")
        print("| path | ms | GB/s |\n|---|---|---|")
        for name, seconds in rows:
            print(f"| {name} | {seconds * 1e3:.1f} | {num_bytes / seconds / 1e9:.2f} |")


if __name__ == "__main__":
    main()
