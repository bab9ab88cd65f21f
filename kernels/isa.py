"""The host's vector ISA flags, which decide which CPU kernels build and how fast matmuls run."""

from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def isa_flags() -> list[str]:
    """The flags of ISA_FLAGS this host has (from /proc/cpuinfo; none where it is absent)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return []
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in ISA_FLAGS if flag in present]
    return []
