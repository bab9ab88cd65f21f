"""The host's ISA flags: the ones of ISA_FLAGS /proc/cpuinfo lists, in ISA_FLAGS' order."""

from pathlib import Path

import pytest
from kvpager.kernels.isa import ISA_FLAGS, isa_flags


def test_isa_flags_are_the_listed_ones_the_host_has():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert isa_flags() == []
        pytest.skip("no /proc/cpuinfo on this host")
    line = next(x for x in cpuinfo.read_text().splitlines() if x.startswith("flags"))
    present = set(line.split(":", 1)[1].split())
    assert isa_flags() == [flag for flag in ISA_FLAGS if flag in present]
