"""Recurrent states in the KV cache's own budget (engine/kv/state_pool.py): the split itself,
the executor's tensors within the budget on Granite 4 and Qwen3-Next tiny hybrids, a budget
holding fewer slots than max_num_seqs serving every request greedy-equal to transformers
(requests queue for slots), host rows carved from the swap space, and `kvpager kv-size`
printing the split the executor allocates."""

import json

import pytest
from kvpager.engine.kv.state_pool import (
    SNAPSHOT_SHARE,
    STATE_SHARE,
    split_beside_blocks,
    split_host_pool,
    split_pool,
)
from kvpager.engine.worker import executor as executor_module
from kvpager.schemas.errors import ConfigError

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model.hybrid_checks import assert_slots_free, greedy
from tests.engine.model.test_parity import hf_greedy
from tests.model_families import build_granite_hybrid, build_qwen3_next

MAX_TOKENS = 6


def test_split_fits_the_budget_states_first():
    split = split_pool(1_000_000, 2048, 6400, max_num_seqs=256)
    assert split.num_slots == int(STATE_SHARE * 1_000_000) // 6400 == 78  # a fair share
    assert split.num_snapshots == int(SNAPSHOT_SHARE * 1_000_000) // 6400
    assert split.total_bytes <= 1_000_000 < split.total_bytes + 2048  # blocks take the rest
    few = split_pool(1_000_000, 2048, 6400, max_num_seqs=4)
    assert few.num_slots == 4 and few.num_blocks > split.num_blocks
    tiny = split_pool(20_000, 2048, 6400, max_num_seqs=8)  # at least one slot
    assert (tiny.num_slots, tiny.num_snapshots, tiny.num_blocks) == (1, 0, 6)
    # a snapshot per block at most: the bytes past that go to blocks
    big_state = split_pool(100_000, 2048, 20_000, max_num_seqs=1)
    assert big_state.num_snapshots <= big_state.num_blocks
    assert big_state.total_bytes <= 100_000
    assert split_pool(10_000, 2048, 0, max_num_seqs=8).num_blocks == 4  # no states
    with pytest.raises(ConfigError, match="no 2048-byte KV block beside 1 state slot"):
        split_pool(8000, 2048, 6400, max_num_seqs=8)


def test_fixed_blocks_and_host_pool():
    beside = split_beside_blocks(100, 2048, 6400, max_num_seqs=8)
    assert (beside.num_slots, beside.num_snapshots, beside.budget_bytes) == (8, 8, 0)
    host = split_host_pool(1 << 20, 2048, 6400, num_slots=8, disk=False)
    assert host.num_slots == 8 and host.num_snapshots == int(0.25 * (1 << 20)) // 6400
    assert host.total_bytes <= 1 << 20 < host.total_bytes + 2048
    assert split_host_pool(0, 2048, 6400, 8, False).total_bytes == 0


@pytest.fixture(scope="module", params=["granite", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    build = {"granite": build_granite_hybrid, "qwen3_next": build_qwen3_next}[request.param]
    return build(tmp_path_factory.mktemp(request.param))


def _device_bytes(executor) -> tuple[int, int]:
    """(KV cache bytes, state bytes) the executor holds on its device."""
    kv = executor.kv_cache.numel() * executor.kv_cache.element_size()
    states = executor.state_cache.states
    held = sum(t.numel() * t.element_size() for t in (states.conv, states.ssm))
    return kv, held


def test_few_slots_queue_and_serve_every_request_exactly(hybrid):
    """A budget that holds 2 state slots with max_num_seqs 8: every request is served (none
    fails for want of a slot), greedy-equal to transformers; at most 2 run at once."""
    probe = make_llm(hybrid, num_blocks=4, max_num_seqs=1)
    slot_bytes = probe.executor.pool.slot_bytes
    probe.close()
    budget = int(2.9 * slot_bytes / STATE_SHARE)  # 2 slots, 1 snapshot, 7 or 8 blocks
    prompts = random_prompts([3, 9, 5, 14, 2, 11, 7, 4], seed=17)
    expected = hf_greedy(hybrid, prompts, MAX_TOKENS)
    with make_llm(
        hybrid, num_blocks=None, kv_cache_memory=budget, max_num_seqs=8, swap_space=1 << 16
    ) as llm:  # fmt: skip
        executor = llm.executor
        kv, states = _device_bytes(executor)
        assert kv + states <= budget  # blocks, slots and snapshots together
        assert states == executor.pool.state_bytes + executor.pool.snapshot_bytes
        assert executor.num_state_slots < 8 and executor.pool.num_blocks == executor.num_blocks
        cpu = executor.cpu_cache.numel() * executor.cpu_cache.element_size()
        host = executor.state_cache.host
        host_bytes = sum(t.numel() * t.element_size() for t in (host.conv, host.ssm))
        assert cpu + host_bytes <= 1 << 16  # host rows carved from the swap space
        assert greedy(llm, prompts, MAX_TOKENS) == expected
        stats = llm.stats()
        assert stats["num_state_slots"] == executor.num_state_slots
        assert stats["peak_running"] <= executor.num_state_slots == 2
        assert stats["peak_waiting"] >= len(prompts) - 2  # they queued for slots
        assert stats["state_slot_bytes"] == slot_bytes
        assert stats["num_free_state_slots"] == executor.num_state_slots
        assert_slots_free(llm)


class _Recorder:
    """Keeps what the executor logs at info level."""

    def __init__(self, logs: list) -> None:
        self.logs = logs

    def info(self, event: str, **fields) -> None:
        self.logs.append((event, fields))


def test_kv_size_prints_the_split_the_executor_allocates(hybrid, capsys, monkeypatch):
    from kvpager.services.cli import main

    budget = 3 << 20  # 3 MiB: a whole number of GiB / 1024
    logs: list[tuple[str, dict]] = []
    monkeypatch.setattr(executor_module, "log", _Recorder(logs))  # the startup log's fields
    with make_llm(hybrid, num_blocks=None, kv_cache_memory=budget, max_num_seqs=64) as llm:
        split = llm.executor.pool
        ready_log = next(fields for event, fields in logs if event == "executor ready")
        assert ready_log["pool_num_slots"] == 64 and ready_log["pool_budget_bytes"] == budget
        assert ready_log["pool_num_blocks"] == llm.executor.num_blocks
        assert ready_log["pool_state_bytes"] == 64 * split.slot_bytes
        ready = llm.executor.ready("x", "m")
        assert (ready.kv_block_bytes, ready.kv_budget_bytes) == (split.block_bytes, budget)
        assert ready.num_state_slots == split.num_slots == 64
    args = ["kv-size", str(hybrid / "config.json"), "--budget-gib", str(budget / 1024**3)]
    args += ["--users", "64", "--block-size", "8", "--dtype", "float32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for line in split.lines():
        assert line in out, (line, out)


def test_kv_size_states_in_the_model_dtype_beside_fp8_kv(hybrid, capsys):
    """fp8 KV halves the blocks' bytes; the states stay in the checkpoint's dtype."""
    from kvpager.services.cli import main

    raw = json.loads((hybrid / "config.json").read_text())
    args = ["kv-size", str(hybrid), "--budget-gib", "0.01", "--kv-cache-dtype", "fp8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    checkpoint = raw.get("torch_dtype") or raw.get("dtype")
    assert f"conv in {checkpoint}" in out and "KV in float8_e4m3fn" in out
