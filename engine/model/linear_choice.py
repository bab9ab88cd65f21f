"""Which matmul a linear runs, chosen once per weight shape at load by timing both: plain
`F.linear` or the oneDNN-packed linear (engine/model/linear.py), for decode-sized row counts
and for larger ones apart.

Why measure rather than fix a rule: on AVX512-BF16 (AMD EPYC Zen 4, no AMX) packed bf16 won at
every SmolLM2 shape and M (1.0-2.3x), but in float32 at M = 1 MKL's plain sgemv beat oneDNN's
packed linear on the 576x576 o_proj (0.7-0.8x) while packed won there from M = 4 on; on an AMX
host the split is again different (docs/design/packed-linears.md has the tables). A choice is
timed once per (out, in, dtype, bias) in a process and cached, on one thread, in 0.2-0.6 s a
shape for SmolLM2's layers; small and very large weights (an lm_head) skip the timing and
pack, a fixed rule (so tiny test models also choose the same in every process).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]

# rows up to this count are "small" (one or two decoding sequences), timed at the first M;
# larger batches are timed at the second
SMALL_ROWS = 2
TIMED_ROWS = (1, 32)
# weights under MIN are packed without timing: a few µs either way, and a fixed choice keeps
# tiny test models identical across processes. Weights over MAX too, which bounds the time
# at load: timing SmolLM2's 49152x576 lm_head took 2 s in float32, and at M = 1 reading the
# weight is the whole cost, so plain and packed were within 10% (at M = 16-64 packed won
# 1.2-3.6x); so 4096x4096 is the largest shape timed (a few 0.1 s).
MIN_TIMED_ELEMENTS, MAX_TIMED_ELEMENTS = 1 << 16, 1 << 24
# plain must beat packed by this factor to be chosen: packed is the default, and timings on a
# shared host are noisy
PLAIN_MARGIN = 1.1
# single calls timed per bucket: as many as BUDGET_S allows, within these bounds
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 40, 0.1


# rows up to this count may run the C kernel over the packed weight (kernels/small_linear.py):
# it streamed SmolLM2's weights faster than oneDNN at M = 1-8 (1.2-5x in most cells), tied at
# 12 and lost from 16 on (docs/design/packed-linears.md)
KERNEL_ROWS = 8
# fp32's AVX2 build (kernels/cpu/small_linear_avx2.h) beat oneDNN 1.15-1.45x at 1-96 rows of
# SmolLM2's decoder linears from memory on a 2-core Zen 3, tied at 128 (oneDNN's large-M
# kernel is as good); on an lm_head 49152 wide it lost at 64 rows (0.68x: its stores, a row
# each 196 KB apart, miss the TLB), so rows x out_features stays under KERNEL_OUT_ELEMENTS
AVX2_KERNEL_ROWS = 64
KERNEL_OUT_ELEMENTS = 1 << 21
# bf16 on AMX tiles (kernels/cpu/amx_linear.c, oneDNN's AB16b32a2b read in place) beat
# oneDNN's packed matmul at 1-128 rows of SmolLM2's decoder linears on a 2-core Xeon (1.1-2.9x;
# level at 128 on gate_up, behind from 256); an output past KERNEL_OUT_ELEMENTS (the lm_head)
# takes one pass of AMX_PASS_ROWS only: a second pass over its rows lost (0.66-0.87x at 33-128)
AMX_KERNEL_ROWS = 128
AMX_PASS_ROWS = 32
# on AVX-512 hosts since its L1 prefetch: fp32's kernel beat oneDNN 1.07-1.16x at 8-128 rows of
# a decode step's decoder linears from memory on a 2-core Xeon with AMX (Sapphire Rapids'
# cores), and on a 2-core Zen 4 (no AMX) fp32 1.0-1.17x and bf16's vdpbf16ps kernel 1.03-1.40x
# at 8-128 rows (benchmarks/reports/2026-12-07-zen4-small-batch-graphs/); from 129 rows
# oneDNN's large-M kernel. Batches up to these rows then replay as decode graphs, where
# oneDNN's matmul, outside the C kernels, kept every step eager
AVX512_KERNEL_ROWS = 128
# ...and a narrow weight (out_features up to AMX_NARROW_COLS: few column blocks, so x is read
# few times) up to a prefill's AMX_NARROW_ROWS: oneDNN's matmul ran SmolLM2's qkv, o_proj and
# down_proj at 1,000 rows at half its rate at 2,048 (its blocking for that M), where the kernel
# was 1.7x (qkv) and 1.9x (down) faster, level on o_proj; gate_up (3072 wide) stays on oneDNN
# (0.74-0.8x at 512-1,000) (benchmarks/reports/2026-12-06-xeon-amx-first-token/)
AMX_NARROW_COLS = 1024
AMX_NARROW_ROWS = 1024
# fp32 from this many rows on the tile unit, each value as three bf16 parts
# (kernels/cpu/amx_linear_f32.c): 1.1-1.6x the faster of oneDNN and the AVX-512 kernel at 32 to
# 2,048 rows of SmolLM2's linears and its lm_head on a 2-core Xeon, mixed at 16-24 (0.8-1.1x),
# behind at 1 (0.3-0.6x: it reads 6 bytes a weight where fp32 reads 4)
AMX_F32_ROWS = 32


@dataclass(frozen=True)
class LinearChoice:
    """Whether the packed linear runs for small (<= SMALL_ROWS) and for larger row counts."""

    packed_small: bool
    packed_large: bool

    @property
    def mixed(self) -> bool:
        """Both paths run, so both the plain and the packed weight stay."""
        return self.packed_small != self.packed_large


ALWAYS_PACKED = LinearChoice(True, True)
_cache: dict[tuple, LinearChoice] = {}
_kernel_cache: dict[tuple, bool] = {}


def fastest_call_us(
    fns: list[LinearFn], x: torch.Tensor, budget_s: float = BUDGET_S
) -> list[float]:
    """Each fn(x)'s fastest single call in µs, the fns taking turns. The minimum of single
    calls, not the mean of a batch: on a shared host a call that waited at a thread barrier
    for another program is slower, never faster, so the fastest one is the uncontended cost."""
    for fn in fns:  # warm: primitives created, pages touched
        fn(x)
    start = time.perf_counter()
    fns[0](x)
    once_s = time.perf_counter() - start
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget_s / max(len(fns) * once_s, 1e-6))))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for idx, fn in enumerate(fns):
            start = time.perf_counter()
            fn(x)
            best[idx] = min(best[idx], (time.perf_counter() - start) * 1e6)
    return best


def choose_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plain: LinearFn,
    packed: LinearFn,
) -> LinearChoice:
    """The faster of `plain` and `packed` (both x [M, in] -> [M, out]) per row bucket, timed on
    zero rows of `weight`'s shape and dtype once per shape in this process."""
    if not MIN_TIMED_ELEMENTS <= weight.numel() <= MAX_TIMED_ELEMENTS:
        return ALWAYS_PACKED
    out_f, in_f = weight.shape
    key = (out_f, in_f, weight.dtype, bias is not None)
    if key not in _cache:
        _cache[key] = _measure(in_f, weight.dtype, plain, packed, key)
    return _cache[key]


def _timed_on_one_thread(
    fns: list[LinearFn], in_f: int, dtype: torch.dtype, row_counts: tuple[int, ...]
) -> dict[int, list[float]]:
    """fastest_call_us of `fns` on zero rows, per row count, on one thread: with two, a call
    whose second thread is descheduled waits at oneDNN's or MKL's barrier for a whole time
    slice; on a busy 2-core host every call did (20 ms for a 30 µs matmul), and the choice was
    noise. One thread has no barrier to wait at."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return {
                rows: fastest_call_us(fns, torch.zeros(rows, in_f, dtype=dtype))
                for rows in row_counts
            }
    finally:
        torch.set_num_threads(threads)


def _measure(
    in_f: int, dtype: torch.dtype, plain: LinearFn, packed: LinearFn, key: tuple
) -> LinearChoice:
    timed = _timed_on_one_thread([plain, packed], in_f, dtype, TIMED_ROWS)
    wins = [plain_us * PLAIN_MARGIN >= packed_us for plain_us, packed_us in timed.values()]
    timings = {f"M={m}": f"plain {a:.0f} us, packed {b:.0f} us" for m, (a, b) in timed.items()}
    choice = LinearChoice(packed_small=wins[0], packed_large=wins[1])
    log.info("linear choice", shape=key[:2], dtype=str(dtype), choice=choice, **timings)
    return choice


def choose_small_kernel(weight: torch.Tensor, packed: LinearFn, kernel: LinearFn) -> bool:
    """Whether `kernel` (the C kernel over the packed weight) beats `packed` (oneDNN) at both 1
    and KERNEL_ROWS rows of `weight`'s shape, timed once per shape in this process as
    `choose_linear` times (one thread, fastest single call)."""
    out_f, in_f = weight.shape
    key = (out_f, in_f, weight.dtype)
    if key not in _kernel_cache:
        _kernel_cache[key] = _kernel_wins(in_f, weight.dtype, packed, kernel, key)
    return _kernel_cache[key]


def _kernel_wins(
    in_f: int, dtype: torch.dtype, packed: LinearFn, kernel: LinearFn, key: tuple
) -> bool:
    timed = _timed_on_one_thread([packed, kernel], in_f, dtype, (1, KERNEL_ROWS))
    wins = all(kernel_us <= packed_us for packed_us, kernel_us in timed.values())
    timings = {f"M={m}": f"oneDNN {a:.0f} us, kernel {b:.0f} us" for m, (a, b) in timed.items()}
    log.info("small-row kernel choice", shape=key[:2], dtype=str(dtype), kernel=wins, **timings)
    return wins
