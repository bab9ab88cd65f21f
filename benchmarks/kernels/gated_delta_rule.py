"""The gated delta rule (Qwen3-Next's DeltaNet layers) on one layer of Qwen3-Next-80B's shape
(16 key heads, 32 value heads, 128 x 128 state): a prefill of `--tokens` tokens and a decode
step of `--seqs` sequences, each on the token-by-token twin (prefill: up to 256 tokens), the
torch chunked form / batched step, and on CUDA the Triton varlen kernel (prefill chunks and
decode tokens alike) and the chunked Triton prefill kernel. Best of `--repeats`; milliseconds
per layer.

    python -m benchmarks.kernels.gated_delta_rule [--tokens 2048] [--seqs 64] [--device cuda]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from kvpager.kernels.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    normalise_qk,
)
from kvpager.kernels.gated_delta_rule_ref import gated_delta_rule_ref

from benchmarks.kernels.cpu_kernels import best_ms_synced as timed

KEY_HEADS, HEADS, DIM, CHUNK = 16, 32, 128, 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def inputs(num_tokens: int, device) -> tuple[torch.Tensor, ...]:
    q, k = normalise_qk(
        torch.randn(num_tokens, KEY_HEADS, DIM, device=device),
        torch.randn(num_tokens, KEY_HEADS, DIM, device=device),
    )
    v = torch.randn(num_tokens, HEADS, DIM, device=device, dtype=torch.bfloat16)
    g = -F.softplus(torch.randn(num_tokens, HEADS, device=device))
    beta = torch.rand(num_tokens, HEADS, device=device, dtype=torch.bfloat16)
    return q, k, v, g, beta


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    prefill, decode = inputs(args.tokens, device), inputs(args.seqs, device)
    state = torch.zeros(HEADS, DIM, DIM, device=device)
    states = torch.zeros(args.seqs, HEADS, DIM, DIM, device=device)
    rows = {
        "prefill_chunked_ms": timed(lambda: gated_delta_rule_chunked(*prefill, state, CHUNK), args),
        "decode_step_ms": timed(lambda: gated_delta_rule_step(*decode, states), args),
    }
    if args.tokens <= 256:
        rows["prefill_twin_ms"] = timed(lambda: gated_delta_rule_ref(*prefill, state), args)
    if device.type == "cuda":
        from kvpager.kernels.gated_delta_rule_triton import gated_delta_rule_varlen

        one = torch.tensor([0, args.tokens], dtype=torch.int32, device=device)
        slots = torch.arange(args.seqs, device=device)
        cu = torch.arange(args.seqs + 1, dtype=torch.int32, device=device)
        run = lambda: gated_delta_rule_varlen(*prefill, one, slots[:1], states)  # noqa: E731
        rows["prefill_triton_ms"] = timed(run, args)
        run = lambda: gated_delta_rule_varlen(*decode, cu, slots, states)  # noqa: E731
        rows["decode_triton_ms"] = timed(run, args)
        from kvpager.kernels.gated_delta_rule_chunk_triton import chunk_gated_delta_rule_varlen

        run = lambda: chunk_gated_delta_rule_varlen(*prefill, one, slots[:1], states)  # noqa: E731
        rows["prefill_triton_chunked_ms"] = timed(run, args)
    result = {"device": str(device), "tokens": args.tokens, "seqs": args.seqs, **rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
