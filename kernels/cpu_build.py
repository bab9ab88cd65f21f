"""Builds the C kernels of the CPU backend (kernels/cpu/*.c) once and loads them with ctypes.

A library is compiled with the system C compiler on first use (Triton needs one too) into
`<cache_dir>/kernels/`, named by a hash of the source, flags and compiler, under a file lock so
concurrent processes build it once. Without a compiler, or when the build fails, `load_library`
returns None and the engine keeps the torch twins.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SOURCES = Path(__file__).parent / "cpu"
# no -ffast-math: it links crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process (every torch op, and hypothesis refuses to run)
FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-ffp-contract=fast",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
# the host's own instruction set; tests also build for "x86-64-v3" (AVX2, no AVX-512) to check
# the code that hosts without AVX-512 run
NATIVE = "native"
I64, PTR, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_LOADED: list[ctypes.CDLL] = []  # every library loaded, for kernels/cpu_graph.py's captures


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_dir() -> Path:
    """Where built libraries live: kvpager's cache folder (the engine's convention, restated
    because kernels imports nothing of the engine)."""
    if explicit := os.environ.get("KVPAGER_CACHE_DIR"):
        return Path(explicit).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvpager" / "kernels"


def _flags(march: str) -> list[str]:
    return [*FLAGS, f"-march={march}"]


def _library_path(compiler: str, source: Path, march: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it includes
    for part in (source.read_bytes(), *headers, " ".join(_flags(march)).encode(), version.encode()):
        digest.update(part)
    return _build_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, source: Path, target: Path, march: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *_flags(march), "-o", str(built), str(source)],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(built, target)


@functools.cache
def load_library(
    name: str, signatures: tuple[tuple[str, tuple], ...], march: str = NATIVE
) -> ctypes.CDLL | None:
    """kernels/cpu/<name>.c compiled for `march` and loaded, its functions typed by
    `signatures` ((function, argtypes) pairs, all returning int), or None when it cannot be
    built here (logged once)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler: the CPU backend keeps its torch twins", kernel=name)
        return None
    source = SOURCES / f"{name}.c"
    try:
        target = _library_path(compiler, source, march)
        if not target.exists():
            log.info("building a CPU kernel", kernel=name, path=str(target))
            _build(compiler, source, target, march)
        library = ctypes.CDLL(str(target))  # after torch: shares its libgomp.so.1
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        log.warning("CPU kernel unavailable", kernel=name, error=detail[-2000:])
        return None
    for function_name, argtypes in signatures:
        function = getattr(library, function_name)
        function.restype, function.argtypes = ctypes.c_int, list(argtypes)
    _LOADED.append(library)
    return library


def loaded_libraries() -> list[ctypes.CDLL]:
    """The kernel libraries this process has loaded (each once)."""
    return list(_LOADED)
