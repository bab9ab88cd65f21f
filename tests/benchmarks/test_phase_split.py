"""benchmarks/peers/phases.py's split, on hand-made steps and on a tiny model's offline run
(benchmarks/engine/phase_split.py)."""

from kvpager.engine import SamplingParams

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm
from benchmarks.engine.phase_split import kvpager_phases, schedule_only
from benchmarks.peers.phases import StepRecord, first_token_times, split


def _steps() -> list[StepRecord]:
    """a (10-token prompt) prefills in one step; b (12) in two chunks; then both decode, a
    finishes, and b decodes alone (the tail, with tail_rows=2)."""
    return [
        StepRecord(1.0, {"a": (10, 10, 10), "b": (6, 6, 12)}),
        StepRecord(2.0, {"a": (1, 11, 10), "b": (6, 12, 12)}),
        StepRecord(2.5, {"a": (1, 12, 10), "b": (1, 13, 12)}),
        StepRecord(3.0, {"a": (1, 13, 10), "b": (1, 14, 12)}),
        StepRecord(3.2, {"b": (1, 15, 12)}),
        StepRecord(3.4, {"b": (1, 16, 12)}),
    ]


def test_first_tokens_come_from_the_chunk_that_completes_the_prompt():
    assert first_token_times(_steps()) == {"a": 1.0, "b": 2.0}


def test_split_by_first_tokens_and_rows():
    result = split(_steps(), tail_rows=2)
    assert result["total_s"] == 3.4
    assert result["ttft_p50_ms"] == 1500.0
    prefill, decode, tail = result["prefill"], result["full decode"], result["tail"]
    assert (prefill["steps"], prefill["wall_s"], prefill["prefill_tokens"]) == (2, 2.0, 22)
    assert prefill["tokens_mean"] == (16 + 7) / 2
    assert (decode["steps"], decode["wall_s"], decode["rows_mean"]) == (2, 1.0, 2.0)
    assert (tail["steps"], tail["wall_s"], tail["rows_mean"]) == (2, 0.4, 1.0)
    assert prefill["steps"] + decode["steps"] + tail["steps"] == len(_steps())
    # the steps after the prefill by rows: each timed from the one before, its mean context
    assert result["by_rows"] == [("1-1", 2, 200.0, 16), ("2-3", 1, 500.0, 14)]


def test_kvpager_phases_of_a_real_run(tiny_llama):
    """Every step is stamped and accounted for, every prompt's tokens counted once, and the
    engine is left as it was (its own schedule and execute, no blocks held)."""
    cfg = BenchConfig(tiny_llama, max_num_batched_tokens=64, max_model_len=256)
    llm = build_llm(cfg, kv_cache_memory=2**22)
    prompts = [[5 + i] * (20 + 7 * i) for i in range(6)]  # 20..55 tokens: 6 chunks of <= 64
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    schedule = llm.scheduler.schedule
    result = kvpager_phases(llm, prompts, params)
    phases = [result[name] for name in ("prefill", "full decode", "tail")]
    assert sum(p.get("prefill_tokens", 0) for p in phases) == sum(map(len, prompts))
    assert result["prefill"]["steps"] >= sum(map(len, prompts)) // 64
    assert phases[2]["steps"] >= 3  # the longest request decodes alone at the end
    assert result["ttft_p50_ms"] <= 1000 * result["total_s"]
    assert llm.scheduler.schedule == schedule
    llm.scheduler.block_manager.check_invariants()
    assert llm.scheduler.block_manager.num_used_blocks == 0
    llm.close()


def test_schedule_alone_gives_the_engines_structure(tiny_llama):
    """The model-free schedule: a budget of 64 over 6 prompts of 20..55 tokens prefills in
    ceil(225 / 64) = 4 steps or one more for the decode rows beside them; a larger budget in
    one; the tail is the longest request's."""
    prompts = [[5 + i] * (20 + 7 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    small, large = schedule_only(64, prompts, params), schedule_only(1024, prompts, params)
    assert small["prefill"]["prefill_tokens"] == large["prefill"]["prefill_tokens"] == 225
    assert small["prefill"]["steps"] in (4, 5) and large["prefill"]["steps"] == 1
    assert large["total_s"] == 1 + 18  # one prefill step, then the 19-token request decodes
