"""Mamba2's recurrence on one layer of a Granite 4 / Nemotron-H shape (128 heads of 64
channels, d_state 128, 8 groups): a prefill of `--tokens` tokens on the torch chunked scan
and, on CUDA, the Triton scan; a decode step of `--seqs` sequences on slots on the torch
twin, the C kernel (CPU) and, on CUDA, the Triton step. Best of `--repeats`; milliseconds
per layer. On a shared host the numbers are rough.

    python -m benchmarks.kernels.mamba2 [--tokens 2048] [--seqs 64] [--device cuda]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from kvpager.kernels.mamba2_scan import ssm_scan_chunked, ssm_step_slots_ref

from benchmarks.kernels.cpu_kernels import best_ms_synced as timed

HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 128, 64, 8, 128, 256


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def inputs(num_tokens: int, heads: int, device) -> tuple[torch.Tensor, ...]:
    x = torch.randn(num_tokens, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
    dt = F.softplus(torch.randn(num_tokens, heads, device=device)) * 0.1
    A, D = -torch.rand(heads, device=device), torch.randn(heads, device=device)
    B = torch.randn(num_tokens, GROUPS, STATE, device=device, dtype=torch.bfloat16)
    C = torch.randn(num_tokens, GROUPS, STATE, device=device, dtype=torch.bfloat16)
    return x, dt, A, B, C, D


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    prefill, decode = inputs(args.tokens, args.heads, device), inputs(args.seqs, args.heads, device)
    states = torch.zeros(args.seqs, args.heads, HEAD_DIM, STATE, device=device)
    slots = torch.randperm(args.seqs, device=device)
    rows = {
        "prefill_chunked_ms": timed(lambda: ssm_scan_chunked(*prefill, states[0], CHUNK), args),
        "decode_twin_ms": timed(lambda: ssm_step_slots_ref(*decode, states, slots), args),
    }
    if device.type == "cpu":
        from kvpager.kernels.cpu_mamba2 import ssm_step_cpu

        rows["decode_c_ms"] = timed(lambda: ssm_step_cpu(*decode, states, slots), args)
    if device.type == "cuda":
        from kvpager.kernels.mamba2_triton import ssm_scan_varlen, ssm_step_slots

        one = torch.tensor([0, args.tokens], dtype=torch.int32, device=device)
        run = lambda: ssm_scan_varlen(*prefill, one, slots[:1], states)  # noqa: E731
        rows["prefill_triton_ms"] = timed(run, args)
        rows["decode_triton_ms"] = timed(lambda: ssm_step_slots(*decode, states, slots), args)
    result = {"device": str(device), "tokens": args.tokens, "seqs": args.seqs, **rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
