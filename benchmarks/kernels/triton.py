"""Kernel benchmark: correctness of every Triton kernel against its twin on CUDA, then paged
attention decode timing against the memory roofline and against SDPA on contiguous K/V.

    python -m benchmarks.kernels.triton --out benchmarks/results/kernels.json [--peak-tbps 4.8]

Bandwidth counts the bytes decode must move: K and V of every context token plus q and out.
Without CUDA it says so, runs a tiny check under the Triton interpreter and exits 0.
"""

import argparse
import json
import os
import sys

import torch

SHAPES = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128)}  # q heads, kv heads, head_dim
BATCH_SIZES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
BLOCK_SIZE = 16


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="device peak (H200: 4.8)")
    parser.add_argument("--max-tokens", type=int, default=1 << 23, help="skip batch*context above")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    return parser.parse_args(argv)


def paged_decode_inputs(batch, context, num_heads, num_kv_heads, head_dim, dtype, device):
    """Decode batch over scrambled blocks: (query, key_cache, value_cache, block_tables,
    cu_seqlens_q, seq_lens) and the same K/V contiguous as [batch, kv_heads, context, d]."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    paged = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens)
    return paged, [_contiguous(cache, block_tables, context) for cache in (key_cache, value_cache)]


def _contiguous(cache, block_tables, context):
    """[batch, kv_heads, context, head_dim] copy of the paged cache, for SDPA."""
    dense = cache[block_tables.long()].flatten(1, 2)[:, :context]
    return dense.transpose(1, 2).contiguous()


def check_correctness(device, dtype) -> dict[str, bool]:
    """Every kernel against its twin on small awkward shapes; exact for data movement."""
    torch.manual_seed(0)
    results = {**_check_kv_write(device, dtype), **_check_attention(device, dtype)}
    results.update(_check_block_ops(device, dtype))
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return results


def _check_kv_write(device, dtype) -> dict[str, bool]:
    from kvpager.kernels import kv_write, reference

    key, value = torch.randn(2, 37, 8, 80, dtype=dtype, device=device)
    cache = torch.randn(2, 20, 16, 8, 80, dtype=dtype, device=device)
    twin = cache.clone()
    slots = torch.randperm(320, device=device)[:37]
    slots[::5] = -1
    kv_write.reshape_and_cache(key, value, cache[0], cache[1], slots)
    reference.reshape_and_cache_ref(key, value, twin[0], twin[1], slots)
    return {"reshape_and_cache": torch.equal(cache, twin)}


def _check_attention(device, dtype) -> dict[str, bool]:
    from kvpager.kernels import paged_attention, reference

    paged, _ = paged_decode_inputs(3, 1000, 28, 4, 128, dtype, device)  # GQA 7
    paged[5].copy_(torch.tensor([1, 999, 513]))
    expected = reference.paged_attention_ref(*paged, 128**-0.5, 1).float()
    results = {}
    for num_splits in (1, 5, None):
        out = paged_attention.paged_attention(*paged, 128**-0.5, 1, num_splits=num_splits)
        error = (out.float() - expected).abs().max().item()
        print(f"  paged_attention num_splits={num_splits}: max abs error {error:.3g}")
        results[f"paged_attention num_splits={num_splits}"] = error < 3e-2
    return results


def _check_block_ops(device, dtype) -> dict[str, bool]:
    from kvpager.kernels import block_ops, reference

    kv_cache = torch.randn(2, 2, 12, 16, 8, 80, dtype=dtype, device=device)
    twin, mapping = kv_cache.clone(), torch.tensor([[3, 0], [11, 5], [4, 7]])
    block_ops.copy_blocks(kv_cache, mapping)
    reference.copy_blocks_ref(twin, mapping.to(device))
    results = {"copy_blocks": torch.equal(kv_cache, twin)}
    pool, pool_twin = torch.zeros_like(kv_cache, device="cpu"), torch.zeros_like(twin, device="cpu")
    block_ops.swap_blocks(kv_cache, pool, mapping)
    reference.swap_blocks_ref(twin, pool_twin, mapping)
    pool += 1  # swap in must carry the pool's current contents back
    pool_twin += 1
    block_ops.swap_blocks(pool, kv_cache, mapping.flip(1))
    reference.swap_blocks_ref(pool_twin, twin, mapping.flip(1))
    results["swap_blocks out"] = torch.equal(pool, pool_twin)
    results["swap_blocks in"] = torch.equal(kv_cache, twin)
    return results


def time_decode(args, dtype) -> list[dict]:
    import triton.testing
    from kvpager.kernels.paged_attention import choose_num_splits, paged_attention

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for model, (num_heads, num_kv_heads, head_dim) in SHAPES.items():
        for batch in BATCH_SIZES:
            for context in CONTEXTS:
                if batch * context > args.max_tokens:
                    continue
                paged, (key, value) = paged_decode_inputs(
                    batch, context, num_heads, num_kv_heads, head_dim, dtype, "cuda"
                )
                scale = head_dim**-0.5
                query = paged[0].unsqueeze(2)  # [batch, heads, 1, d]

                def run_paged(paged=paged, scale=scale):
                    return paged_attention(*paged, scale, 1)

                def run_sdpa(query=query, key=key, value=value):
                    return torch.nn.functional.scaled_dot_product_attention(
                        query, key, value, enable_gqa=True
                    )

                ms = triton.testing.do_bench(run_paged, return_mode="median")
                sdpa_ms = triton.testing.do_bench(run_sdpa, return_mode="median")
                kv_bytes = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize
                nbytes = kv_bytes + 2 * query.numel() * dtype.itemsize
                tbps = nbytes / (ms * 1e-3) / 1e12
                splits = choose_num_splits(batch, num_kv_heads, 1, context, num_sms)
                rows.append(
                    {
                        "model": model, "batch": batch, "context": context,
                        "num_splits": splits, "ms": ms, "tbps": tbps,
                        "peak_fraction": tbps / args.peak_tbps, "sdpa_ms": sdpa_ms,
                        "sdpa_tbps": nbytes / (sdpa_ms * 1e-3) / 1e12,
                    }
                )  # fmt: skip
                print(_format_row(rows[-1]), flush=True)
                del paged, key, value, query
                torch.cuda.empty_cache()
    return rows


HEADER = f"{'model':<11} {'batch':>5} {'context':>7} {'splits':>6} {'ms':>8} {'TB/s':>6} "
HEADER += f"{'%peak':>6} {'sdpa ms':>8} {'sdpa TB/s':>9}"


def _format_row(row) -> str:
    return (
        f"{row['model']:<11} {row['batch']:>5} {row['context']:>7} {row['num_splits']:>6} "
        f"{row['ms']:>8.3f} {row['tbps']:>6.2f} {100 * row['peak_fraction']:>5.1f}% "
        f"{row['sdpa_ms']:>8.3f} {row['sdpa_tbps']:>9.2f}"
    )


def smoke_check() -> bool:
    """Tiny decode and KV write under the Triton interpreter, against the twins."""
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels
    from kvpager.kernels import kv_write, paged_attention, reference

    torch.manual_seed(0)
    paged, _ = paged_decode_inputs(2, 40, 4, 2, 80, torch.float32, "cpu")
    out = paged_attention.paged_attention(*paged, 0.1, 1, num_splits=2)
    ok = torch.allclose(out, reference.paged_attention_ref(*paged, 0.1, 1), atol=1e-4)
    key, slots = torch.randn(3, 2, 80), torch.tensor([5, -1, 70])
    caches = [paged[1].clone() for _ in range(4)]
    kv_write.reshape_and_cache(key, key, caches[0], caches[1], slots)
    reference.reshape_and_cache_ref(key, key, caches[2], caches[3], slots)
    return ok and torch.equal(caches[0], caches[2])


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: nothing to time. Running a CPU interpreter smoke check instead.")
        ok = smoke_check()
        print(f"interpreter smoke check: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name()}  peak {args.peak_tbps} TB/s  dtype {dtype}")
    print("correctness against the torch twins:")
    correctness = check_correctness("cuda", dtype)
    print(HEADER)
    rows = time_decode(args, dtype)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        report = {
            "device": torch.cuda.get_device_name(),
            "peak_tbps": args.peak_tbps,
            "dtype": args.dtype,
            "correctness": correctness,
            "decode": rows,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if all(correctness.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
