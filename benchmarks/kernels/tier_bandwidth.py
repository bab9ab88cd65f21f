"""What the KV tiers read back at, beside what the host copies and reads, in one run.

A returning conversation's blocks come back from the CPU pool (a swap-in: the backend's
`swap_blocks`) and from disk (DiskStore's reader threads into the CPU pool, then the swap-in).
Each is timed over the same bytes as a plain `memcpy` (a torch copy of one contiguous buffer)
and a plain read of the same files (and of one file of the same total size), so the tiers'
rates read as a fraction of what the host allows. SmolLM2-135M's block layout (30 layers,
3 KV heads, head_dim 64, 16-token blocks, bf16: 368 KiB a block); the device pool is CUDA's
when there is one, else host memory as on a CPU host. Disk reads come from the page cache
unless the files were evicted from it (a fresh `--dir` on a cold disk, or dropped caches):
the table says which. Nothing else should run meanwhile.

    python -m benchmarks.kernels.tier_bandwidth [--blocks 1024] [--dir /var/tmp/kv] [--smoke]
"""

import argparse
import hashlib
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from kvpager.engine.worker.disk.files import BlockLayout, file_name
from kvpager.engine.worker.disk.store import NUM_READERS, DiskStore
from kvpager.kernels.backend import default_backend_name, get_kernel_ops
from kvpager.kernels.isa import isa_flags
from kvpager.kernels.reference import swap_blocks_ref
from kvpager.schemas.executor import DiskBlock
from kvpager.schemas.scheduler import StepOutput

from benchmarks.kernels.cpu_kernels import BLOCK, HEAD_DIM, KV_HEADS, LAYERS


def lscpu_flags() -> str:
    """lscpu's model name and flags line (the host these numbers come from)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu: unavailable"
    keep = ("Model name", "CPU(s)", "Flags")
    return "\n".join(line for line in text.splitlines() if line.startswith(keep))


def best_s(fn, repeats: int) -> float:
    fn()  # warm: allocations, page faults, the page cache
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def caches(num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(CPU pool, device pool), both [layers, 2, blocks, block_size, kv heads, head_dim]."""
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pin = device.type == "cuda"
    cpu = torch.randn(shape).bfloat16()
    if pin:
        cpu = cpu.pin_memory()
    return cpu, torch.zeros(shape, dtype=torch.bfloat16, device=device)


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


def disk_rows(cpu, dev, folder: Path, repeats: int) -> list[tuple[str, float]]:
    num_blocks = cpu.shape[2]
    layout = BlockLayout(
        (LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), torch.bfloat16, hashlib.sha256(b"bench").digest()
    )
    key = hashlib.sha256(b"tier bandwidth").digest()
    store = DiskStore(folder, 1 << 40, layout, key)
    blocks = [
        DiskBlock(hashlib.sha256(i.to_bytes(4, "little")).digest(), i, list(range(BLOCK)))
        for i in range(num_blocks)
    ]
    store.save(blocks, cpu, cpu)
    store.flush()
    target = torch.zeros_like(cpu)

    def disk_to_cpu() -> None:
        store.load(blocks, target)
        output = StepOutput(step_id=0)
        store.report(output, wait=True)
        assert len(output.disk_loaded) == num_blocks, "a read failed"

    swap = get_kernel_ops(default_backend_name(dev.device)).swap_blocks
    mapping = mappings(num_blocks)["consecutive"]

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

    rows = [
        (
            f"disk -> CPU pool ({NUM_READERS} reader threads, HMAC checked)",
            best_s(disk_to_cpu, repeats),
        ),
        ("disk -> CPU pool -> device pool (the engine's path)", best_s(disk_to_device, repeats)),
        ("plain read of the same files, one thread", best_s(plain_reads, repeats)),
        ("plain read of one file of the same bytes", best_s(one_file, repeats)),
    ]
    store.close()
    assert torch.equal(target, cpu), "the blocks read differ from those written"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved (368 KiB each)")
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
    cpu, dev = caches(args.blocks, device)
    num_bytes = cpu.numel() * cpu.element_size()
    root = Path(tempfile.mkdtemp(prefix="tier-bw-", dir=args.dir))
    try:
        rows = cpu_tier_rows(cpu, dev, args.repeats) + disk_rows(cpu, dev, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.blocks} blocks, {num_bytes / 1e6:.0f} MB; files read from the page cache")
    print("| path | ms | GB/s |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {num_bytes / seconds / 1e9:.2f} |")


if __name__ == "__main__":
    main()
