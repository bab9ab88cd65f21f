"""SmolLM2-135M's linears, µs per call: plain `F.linear` against the oneDNN-packed linear
(engine/model/linear.py), per shape, rows M and dtype; lscpu flags printed first.

    python -m benchmarks.kernels.packed_linears [--threads 2] [--budget-s 1] [--rows 1,4,16,64,256]

Plain bf16 reaches oneDNN's matmul with the weight in its plain `ba` layout on every call;
plain fp32 reaches MKL's sgemm. The packed path reads a weight reordered once at load
(`AB16b64a2b` in bf16 on AVX512-BF16). `--smoke` runs two small shapes at M = 1, 4 only.
Each number is the fastest of single calls (the two paths taking turns, up to `--budget-s`
seconds): the uncontended cost. Nothing else should run meanwhile all the same.
"""

import argparse

import torch
import torch.nn.functional as F
from kvpager.engine.model.linear import onednn_packing_supported, pack_weight, packed_linear
from kvpager.engine.model.linear_choice import fastest_call_us

from benchmarks.kernels.tier_reads import lscpu_flags

# (name, out, in): SmolLM2-135M's fused q|k|v, o, gate|up, down, and its (tied) lm_head
SHAPES = (
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
)
SMOKE_SHAPES = (("o_proj/8", 72, 72), ("down/8", 72, 192))


def plain_and_packed_us(
    out_f: int, in_f: int, rows: int, dtype: torch.dtype, budget_s: float
) -> tuple[float, float]:
    """The fastest call's µs of F.linear and of the packed linear on the same weight and rows,
    timed as the load-time choice times them (engine/model/linear_choice.py)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    packed = pack_weight(weight)
    assert packed is not None, "the caller checks onednn_packing_supported"
    plain_us, packed_us = fastest_call_us(
        [lambda x: F.linear(x, weight), lambda x: packed_linear(x, packed, None)], x, budget_s
    )
    return plain_us, packed_us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=1.0, help="timing per shape and M")
    parser.add_argument("--rows", default="1,4,16,64,256", help="M values, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="two small shapes, M = 1 and 4")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, rows = SHAPES, [int(m) for m in args.rows.split(",")]
    if args.smoke:
        shapes, rows, args.budget_s = SMOKE_SHAPES, [1, 4], 0.01
    print(lscpu_flags())
    print(f"torch {torch.__version__}, {args.threads} threads; µs per call, plain / packed")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            if not onednn_packing_supported(torch.empty(1, dtype=dtype)):
                print(f"{dtype}: no packed path on this host")
                continue
            for name, out_f, in_f in shapes:
                cells = []
                for m in rows:
                    plain, packed = plain_and_packed_us(out_f, in_f, m, dtype, args.budget_s)
                    cells.append(f"M={m}: {plain:8.1f} / {packed:8.1f} x{plain / packed:4.2f}")
                print(f"{str(dtype)[6:]:8} {name:8} {out_f}x{in_f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
