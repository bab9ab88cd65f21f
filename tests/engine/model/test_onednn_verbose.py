"""What oneDNN runs for a packed linear (engine/model/linear.py), read from ONEDNN_VERBOSE=1
in a subprocess: the weight is reordered once, at load, and never at run time, and every
call's matmul reads the blocked weight (`AB16b64a2b` in bf16 on AVX512-BF16, `AB16b64a` in
fp32), not the plain `ab` / `ba` one that `F.linear` passes. Row counts the C kernel takes
(kernels/small_linear.py, reading the same packed buffer) leave no oneDNN line at all."""

import os
import re
import subprocess
import sys

import pytest
import torch
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.linear import onednn_packing_supported

pytestmark = pytest.mark.skipif(
    not onednn_packing_supported(torch.empty(1)), reason="no oneDNN packed linear in this build"
)
BF16 = pytest.param(
    "bfloat16",
    marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16: not packed"),
)
MARK = "=== calls start"
# [out, in] of SmolLM2's o_proj and down, and the row counts of decode and of a prefill chunk
# (2048: past every kernel's rows, AMX's 1,024 for narrow weights like these included)
SCRIPT = """
import sys, torch
from kvpager.engine.model import linear
from kvpager.engine.model.linear import make_linear
from kvpager.kernels import small_linear
linear.F32_TILES_ON = False  # fp32 on AMX tiles (its own tests) would take the 2048 rows
kernel, kernel_calls = small_linear.small_linear, []
small_linear.small_linear = lambda *a: kernel_calls.append(1) or kernel(*a)
dtype = getattr(torch, sys.argv[1])
fns = [make_linear(torch.randn(576, n).to(dtype), None, measure=False) for n in (576, 1536)]
assert all(packed for _, packed in fns)
print("{mark}", flush=True)
for (fn, _), n in zip(fns, (576, 1536)):
    for rows in (1, 4, 2048):
        fn(torch.randn(rows, n).to(dtype))
print("kernel calls", len(kernel_calls), flush=True)
"""


def run_verbose(dtype: str, **env_vars: str) -> tuple[list[str], list[str], int]:
    """oneDNN's exec lines before and after the calls start, and the small-row kernel's calls."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", **env_vars}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(mark=MARK), dtype],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    at = lines.index(MARK)
    execs = [[line for line in part if ",exec," in line] for part in (lines[:at], lines[at:])]
    kernel_calls = int(lines[-1].removeprefix("kernel calls "))
    return execs[0], execs[1], kernel_calls


def assert_packed_once(load: list[str], calls: list[str], dtype: str, kernel_calls: int) -> None:
    short = "bf16" if dtype == "bfloat16" else "f32"
    assert sum(",reorder," in line for line in load) == 2  # one per weight, at load
    assert kernel_calls in (0, 4)  # rows 1 and 4 of both weights, or none
    assert len(calls) == 6 - kernel_calls and not any(",reorder," in line for line in calls)
    for line in calls:
        weight = re.search(r"wei:(\w+)::blocked:(\w+)", line)
        assert weight, line
        assert weight.group(1) == short and weight.group(2) not in ("ab", "ba"), line
        assert re.search(r"\d", weight.group(2)), line  # a blocked tag: AB16b64a2b, ...


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_weights_reorder_once_and_calls_read_the_blocked_layout(dtype):
    load, calls, kernel_calls = run_verbose(dtype)
    assert_packed_once(load, calls, dtype, kernel_calls)
    if dtype == "bfloat16":  # the kernel named: AVX512-BF16's brgemm, or AMX's
        assert all(re.search(r"brg\w*:\w*(bf16|amx)", line) for line in calls), calls[0]


def test_an_avx2_host_packs_float32_and_leaves_bf16_plain():
    """oneDNN held to AVX2 (what an AVX2-only host gets): float32 still runs packed, on the
    AVX2 kernel; bf16 is not native there, so it is not packed (F.linear runs it)."""
    load, calls, kernel_calls = run_verbose("float32", ONEDNN_MAX_CPU_ISA="AVX2")
    assert_packed_once(load, calls, "float32", kernel_calls)
    assert all("avx2" in line and "avx512" not in line for line in calls), calls[0]
    check = "from kvpager.engine.memory import cpu_has_native_bf16 as f; print(f())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    native = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, check=True
    )
    assert native.stdout.strip() == "False"
