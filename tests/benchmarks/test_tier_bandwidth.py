"""benchmarks/kernels/tier_bandwidth.py at 4 blocks: every path runs, the blocks read back
from disk are the ones written (the script checks), and the reference rows are there."""

import torch

from benchmarks.kernels import tier_bandwidth


def test_every_path_runs_and_reads_back_what_it_wrote(tmp_path):
    cpu, dev = tier_bandwidth.caches(4, torch.device("cpu"))
    rows = tier_bandwidth.cpu_tier_rows(cpu, dev, repeats=1)
    rows += tier_bandwidth.disk_rows(cpu, dev, tmp_path, repeats=1)
    names = [name for name, _ in rows]
    assert any(name.startswith("memcpy") for name in names)
    assert any(name.startswith("plain read of the same files") for name in names)
    assert sum(name.startswith("CPU pool -> device pool") for name in names) == 4
    assert all(seconds > 0 for _, seconds in rows)
    assert torch.equal(dev, cpu)  # the last swap moved every block, in place


def test_lscpu_flags_names_the_host():
    assert tier_bandwidth.lscpu_flags()
