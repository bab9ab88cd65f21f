"""How busy the machine was with other work: a measured run is only as good as its quiet.

`other_cores` = CPU time the whole machine spent busy (including time stolen by the
hypervisor) minus what this process and its children (the vLLM worker) used, per second of
wall time. On 2 cores, threads of an engine that share their cores with another program wait
at every OpenMP barrier; a run with other_cores near 1 can be several times slower.
"""

import os
import platform
import time
from pathlib import Path

import psutil

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (of /proc/stat "cpu")


def _busy_seconds() -> float:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    return sum(int(fields[i]) for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class CpuWatch:
    """Start at construction; `other_cores()` covers the time since."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()

    def other_cores(self) -> float:
        wall = time.perf_counter() - self.wall
        busy, own = _busy_seconds() - self.busy, _own_seconds() - self.own
        return max(0.0, (busy - own) / max(wall, 1e-6))


def wait_for_quiet(max_wait_s: float, threshold: float = 0.25, window_s: float = 2.0) -> float:
    """Wait (up to max_wait_s) until other programs use under `threshold` cores over a window;
    returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    while True:
        watch = CpuWatch()
        time.sleep(window_s)
        reading = watch.other_cores()
        if reading < threshold or time.monotonic() >= deadline:
            return reading


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
