"""benchmarks/vllm_attention.py's own half (vLLM's needs its venv): it times the C kernel and
prints the table it promises."""

import pytest
from kvpager.kernels import cpu_decode, cpu_tiles

from benchmarks.kernels import vllm_attention

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler here")


def test_kvpager_half_runs_and_prints_its_row(capsys):
    assert vllm_attention.kvpager_ms(seqs=2, context=20, repeats=1, threads=1) > 0
    vllm_attention.main(["--seqs", "2", "--context", "20", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "ISA:" in out and "| kvpager C kernel |" in out and "1.00x" in out


@pytest.mark.skipif(not cpu_tiles.available(), reason="neither AMX nor AVX512-BF16 here")
def test_a_host_with_the_tile_kernel_gets_its_row(capsys):
    assert vllm_attention.kvpager_ms(seqs=2, context=20, repeats=1, threads=1, tiles=True) > 0
    vllm_attention.main(["--seqs", "2", "--context", "20", "--repeats", "1", "--threads", "1"])
    assert "| kvpager tile layout |" in capsys.readouterr().out
