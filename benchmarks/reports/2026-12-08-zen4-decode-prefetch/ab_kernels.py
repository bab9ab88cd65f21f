"""Decode attention before and after this report's prefetch changes, in one process, rounds
interleaved: the tile kernel (kernels/cpu/paged_tiles.c, bf16 cache in the tile layout) and the
token-major kernel (kernels/cpu/paged_decode.c, fp32 and bf16 caches), each built from a git
revision's sources and from the working tree with the engine's own flags, on SmolLM2's decode
shape (9 query / 3 KV heads of 64, 16-token blocks, 30 layers cycling so the cache comes from
memory). Best ms a layer of `--rounds`.

    python benchmarks/reports/2026-12-08-zen4-decode-prefetch/ab_kernels.py --base abf550f \
        [--tables random|contiguous] [--threads 2]
"""

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from kvpager.kernels import cpu_build, cpu_decode, cpu_tiles
from kvpager.kernels.isa import isa_flags

ROOT = Path(__file__).resolve().parents[3]
LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16
SHAPES = [(64, 320), (64, 1024), (16, 600), (8, 2000), (128, 200)]  # sequences x context


def sources_at(revision: str, into: Path) -> Path:
    """kernels/cpu/ as it was at `revision`, written under `into`."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "kernels/cpu/"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for path in listing:
        text = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        (into / Path(path).name).write_bytes(text)
    return into


def build(source: Path, signatures, out: Path) -> ctypes.CDLL:
    subprocess.run(
        ["cc", *cpu_build._flags(cpu_build.NATIVE), "-o", str(out), str(source)], check=True
    )
    library = ctypes.CDLL(str(out))
    for name, argtypes in signatures:
        function = getattr(library, name)
        function.restype, function.argtypes = ctypes.c_int, list(argtypes)
    return library


def inputs(seqs: int, context: int, dtype: torch.dtype, tiles: bool, random_tables: bool):
    per = context // BLOCK + 1
    caches = []
    for _ in range(LAYERS):
        k, v = (torch.randn(seqs * per, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
        caches.append(
            (cpu_tiles.to_tiles(k, False), cpu_tiles.to_tiles(v, True)) if tiles else (k, v)
        )
    order = torch.randperm(seqs * per) if random_tables else torch.arange(seqs * per)
    query = torch.randn(seqs, HEADS, HEAD_DIM).to(torch.bfloat16 if tiles else torch.float32)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    return caches, query, order.int().view(seqs, per), lens


def layer_ms(decode, caches, query, tables, lens) -> float:
    start = time.perf_counter()
    for key_cache, value_cache in caches:
        assert decode(query, key_cache, value_cache, tables, lens, HEAD_DIM**-0.5) is not None
    return (time.perf_counter() - start) / LAYERS * 1e3


def compare(kind: str, module, decode, libraries: dict, shape, dtype, args) -> str:
    tiles = module is cpu_tiles
    data = inputs(*shape, dtype, tiles, args.tables == "random")
    best = {name: float("inf") for name in libraries}
    for _ in range(args.rounds + 1):  # the first round warms each library
        for name, library in libraries.items():
            module.load = lambda march=cpu_build.NATIVE, library=library: library
            best[name] = min(best[name], layer_ms(decode, *data))
    base, new = best.values()
    return f"| {kind} | {shape[0]} x {shape[1]} | {base:.3f} | {new:.3f} | {new / base:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the sources before")
    parser.add_argument("--tables", choices=["random", "contiguous"], default="random")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ISA flags: {' '.join(isa_flags())}; {args.threads} threads; {args.tables} tables")
    print("| kernel | sequences x context | before ms a layer | after | after / before |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        old = sources_at(args.base, Path(tmp))
        new = ROOT / "kernels" / "cpu"
        kernels = [("tile layout, bf16", cpu_tiles, cpu_tiles.paged_decode_tiles, "paged_tiles",
                    torch.bfloat16, cpu_tiles._SIGNATURES)]  # fmt: skip
        if not cpu_tiles.available():
            kernels = []  # neither AMX nor AVX512-BF16: no tile kernel here
        kernels += [
            ("token-major, fp32", cpu_decode, cpu_decode.paged_decode, "paged_decode",
             torch.float32, cpu_decode._SIGNATURES),
            ("token-major, bf16", cpu_decode, cpu_decode.paged_decode, "paged_decode",
             torch.bfloat16, cpu_decode._SIGNATURES),
        ]  # fmt: skip
        for kind, module, decode, name, dtype, signatures in kernels:
            libraries = {
                "before": build(old / f"{name}.c", signatures, Path(tmp) / f"{name}-before.so"),
                "after": build(new / f"{name}.c", signatures, Path(tmp) / f"{name}-after.so"),
            }
            for shape in SHAPES:
                print(compare(kind, module, decode, libraries, shape, dtype, args), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
