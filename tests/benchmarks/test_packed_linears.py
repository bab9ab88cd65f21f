"""benchmarks/kernels/packed_linears.py at its smoke size: the host's flags, then a plain /
packed row per shape and dtype with positive times (the numbers themselves are not checked:
the machine is shared)."""

import re

import torch
from kvpager.engine.model.linear import onednn_packing_supported

from benchmarks.kernels import packed_linears


def test_smoke_prints_flags_and_a_row_per_shape(capsys):
    packed_linears.main(["--smoke", "--threads", "1"])
    out = capsys.readouterr().out
    assert "Flags:" in out or "lscpu: unavailable" in out
    rows = [line for line in out.splitlines() if "M=1:" in line]
    packable = [
        dtype
        for dtype in (torch.float32, torch.bfloat16)
        if onednn_packing_supported(torch.empty(1, dtype=dtype))
    ]
    assert len(rows) == len(packable) * len(packed_linears.SMOKE_SHAPES)
    for line in rows:
        times = [float(t) for t in re.findall(r"M=\d+:\s+([\d.]+) /\s+([\d.]+)", line)[0]]
        assert all(t > 0 for t in times), line
