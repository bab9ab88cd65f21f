"""benchmarks/op_breakdown.py's clock and table: what it derives from the timed calls."""

import time

from benchmarks.engine.op_breakdown import LINEARS, OPS, Clock, table, workload_requests
from benchmarks.peers.vllm_profile import OTHER, group


def test_clock_counts_calls_and_time_and_keeps_results_and_errors():
    clock = Clock()
    slow = clock.wrap("slow", lambda x: (time.sleep(0.01), x * 2)[1])
    assert slow(3) == 6 and slow(4) == 8
    failing = clock.wrap("failing", lambda: 1 / 0)
    try:
        failing()
    except ZeroDivisionError:
        pass
    assert clock.calls == {"slow": 2, "failing": 1}
    assert clock.seconds["slow"] >= 0.02


def test_table_derives_the_rest_of_the_forward_and_of_the_step():
    clock = Clock()
    for name in LINEARS:
        clock.seconds[f"linear {name}"] = 1.0
    for name in OPS:
        clock.seconds[name] = 0.5
    clock.seconds.update({"attention": 2.0, "lm_head": 1.0, "forward": 9.0, "step": 11.0})
    rows = {name: seconds for name, seconds, _ in table(clock, elapsed=12.0)}
    assert rows["linear, all four"] == 4.0
    assert rows["forward, other"] == 9.0 - 4.0 - 2.0 - 2.0
    assert rows["step outside forward and lm_head"] == 11.0 - 9.0 - 1.0
    assert rows["outside steps (scheduler, output)"] == 1.0
    assert "forward" not in rows and "step" not in rows
    assert list(rows.values()) == sorted(rows.values(), reverse=True)


def test_prefix_repetition_is_serve_benchs_shape(tiny_llama):
    """8 prefixes of 256 tokens, each request's own 64-token suffix, 64 tokens out."""
    prompts, params = workload_requests(tiny_llama, 16, "prefix-repetition")
    assert len(prompts) == 16 and all(len(p) == 320 for p in prompts)
    assert len({tuple(p[:256]) for p in prompts}) == 8
    assert len({tuple(p[256:]) for p in prompts}) == 16
    assert all(p.max_tokens == 64 and p.ignore_eos for p in params)


def test_vllm_profile_groups_every_op_into_one_category():
    """vLLM's profiled ops -> op_breakdown's categories; nothing is dropped or counted twice."""
    ops = {
        "_C::onednn_mm": 16.0,
        "_C::cpu_attention_with_kv_cache": 7.0,
        "## Call CompiledFxGraph None ##": 1.8,
        "vllm::unified_kv_cache_update": 0.5,
        "_C::cpu_attn_reshape_and_cache": 0.25,
        "aten::copy_": 0.1,
        "aten::view": 0.05,
    }
    grouped = group(ops)
    assert grouped["linears and lm_head (oneDNN)"] == 16.0
    assert grouped["attention"] == 7.0
    assert grouped["cache write"] == 0.75
    assert grouped["compiled graph's own code (norms, rotary, activation)"] == 1.8
    assert abs(grouped[OTHER] - 0.15) < 1e-9
    assert abs(sum(grouped.values()) - sum(ops.values())) < 1e-9
