"""How far the tile kernel's fp32 output is from the fp32 twin (kernels/reference.py) on the
tile tests' batches, beside what rounding the twin itself to bf16 moves it (max abs).

    PYTHONPATH=. python benchmarks/reports/2026-12-06-xeon-amx-first-token/p_rounding.py
"""

import dataclasses

import torch
from kvpager.kernels.reference import paged_attention_ref

from tests.kernels import test_cpu_tiles as tiles
from tests.kernels.test_paged_attention import DECODE, MIXED, make_batch

for name, case in (("DECODE", DECODE), ("MIXED", MIXED), ("UNITS", tiles.UNITS)):
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    out = tiles._fp32_tile_output(batch, 0.125)
    twin = paged_attention_ref(*dataclasses.replace(batch, query=batch.query.float()).args(0.125))
    print(
        f"{name}: kernel's fp32 output {(out - twin).abs().max():.2e}, "
        f"rounded to bf16 {(out.bfloat16().float() - twin).abs().max():.2e}; "
        f"the twin rounded to bf16 {(twin.bfloat16().float() - twin).abs().max():.2e}"
    )
