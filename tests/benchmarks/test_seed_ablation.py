"""The seed-like ablation on a tiny model: every arm runs the same tokens; paging with prefix
sharing admits more requests at once than max-length reservation at the same KV memory."""

import pytest

from benchmarks.engine import seed_ablation


@pytest.mark.timeout(600)
def test_sharing_admits_more_than_max_length_reservation(tiny_llama):
    rows = seed_ablation.main(
        [
            "--model", str(tiny_llama), "--dtype", "float32", "-n", "8",
            "--system-len", "48", "--max-model-len", "128", "--reservations", "2",
        ]
    )  # fmt: skip
    by_arm = {r["arm"].split(",")[0]: r for r in rows}
    sharing, reserved = rows[0], rows[-1]
    assert sharing["arm"] == "paged + prefix sharing" and "contiguous" in by_arm
    assert reserved["peak_running"] == 2  # two max-length reservations fit, no more
    assert sharing["peak_running"] > reserved["peak_running"]
    assert sharing["prefix_hit_tokens"] > 0 and rows[1]["prefix_hit_tokens"] == 0
    assert len({r["num_output_tokens"] for r in rows}) == 1
