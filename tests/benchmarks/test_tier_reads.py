"""benchmarks/kernels/tier_reads.py at 4 blocks: every path runs in both dtypes, warm and cold,
the blocks read back from disk are the ones written (the script checks), and the reference
rows are there."""

import pytest
import torch

from benchmarks.kernels import tier_reads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_runs_and_reads_back_what_it_wrote(tmp_path, dtype):
    cpu, dev = tier_reads.caches(4, torch.device("cpu"), dtype)
    rows = tier_reads.cpu_tier_rows(cpu, dev, repeats=1)
    rows += tier_reads.mac_rows(cpu, repeats=1)
    rows += tier_reads.disk_rows(cpu, dev, tmp_path, repeats=1)
    names = [name for name, _ in rows]
    assert any(name.startswith("memcpy") for name in names)
    assert sum(name.startswith("MAC alone") for name in names) == 2
    assert sum(name.startswith("plain read of the same files") for name in names) == 2
    assert any(name.endswith(", cold") for name in names) == tier_reads.COLD_ADVICE
    assert sum(name.startswith("CPU pool -> device pool") for name in names) == 4
    assert all(seconds > 0 for _, seconds in rows)
    assert torch.equal(dev, cpu)  # the last swap moved every block, in place


def test_lscpu_flags_names_the_host():
    assert tier_reads.lscpu_flags()
