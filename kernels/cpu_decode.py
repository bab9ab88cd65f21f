"""The CPU decode-attention kernel (kernels/cpu/paged_decode.c): built once, called via ctypes.

Why C here: on CPU the torch twin gathers every sequence's K/V blocks into a padded copy and
then runs SDPA, reading and writing the context three times; the kernel reads each K/V row once,
in place, through the block table (SmolLM2, 48 sequences of ~250 tokens: attention per decode
step 124 ms -> 41-55 ms). It is the CPU counterpart of the Triton kernel, tested against the
same torch twin.

The library is compiled with the system C compiler on first use (Triton needs one too) into
`<cache_dir>/kernels/`, named by a hash of the source, flags and compiler, under a file lock so
concurrent processes build it once. Without a compiler, or when the build fails, `load()`
returns None and the engine keeps the torch path.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import structlog
import torch

from kernels.reference import decode_attention_ref, paged_attention_ref

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "paged_decode.c"
# no -ffast-math: it links crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process (every torch op, and hypothesis refuses to run)
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-ffp-contract=fast",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR] + [_I64] * 6 + [ctypes.c_float]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    from engine.download import cache_dir

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        digest.update(part)
    return cache_dir() / "kernels" / f"paged_decode-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(built, target)


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built here (logged once)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler: CPU decode attention stays on the torch path")
        return None
    try:
        target = _library_path(compiler)
        if not target.exists():
            log.info("building the CPU decode-attention kernel", path=str(target))
            _build(compiler, target)
        library = ctypes.CDLL(str(target))  # after torch: shares its libgomp.so.1
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        log.warning("CPU decode-attention kernel unavailable", error=detail[-2000:])
        return None
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        function = getattr(library, name)
        function.restype, function.argtypes = ctypes.c_int, _ARGTYPES
    return library


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """One query token per sequence over paged K/V: fp32 [num_seqs, heads, d], or None when the
    kernel does not take these inputs (then the caller uses the torch twin)."""
    library = load()
    if library is None or key_cache.dtype not in (torch.float32, torch.bfloat16):
        return None
    query = query.float().contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    function = (
        library.paged_decode_f32 if key_cache.dtype == torch.float32 else library.paged_decode_bf16
    )
    status = function(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.get_num_threads(),
        scale,
    )
    return out if status == 0 else None


def _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    out = paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        return decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return out


# `paged_attention_ref` with its decode rows on the C kernel (prefill chunks stay on SDPA)
paged_attention_cpu = functools.partial(paged_attention_ref, decode=_decode_rows)
