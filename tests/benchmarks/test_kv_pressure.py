"""benchmarks/engine/kv_pressure.py at a small size: the replay finishes under every policy with
its block accounting intact, and the policies differ the way they should (behaviour, no
timing)."""

from benchmarks.engine.kv_pressure import POLICIES, Workload, replay, summary

SMALL = Workload(turns=2)


def first_token_steps(policy: str) -> list[int]:
    run = replay(POLICIES[policy], SMALL)
    return [run.tracks[f"c{conv}-t0"].first[0] for conv in range(SMALL.num_conversations)]


def test_long_prompts_arriving_together_finish_one_after_another():
    before = first_token_steps("serve-before")
    assert before[0] == before[1] == before[2]  # capped and sharing every step: all at once
    now = first_token_steps("serve")
    assert now[0] < now[1] < now[2] and now[0] <= before[0]  # first come, first finished


def test_reserving_prompt_blocks_ends_preemption_here():
    plain, reserved = (replay(POLICIES[name], SMALL) for name in ("serve", "serve+reserve"))
    assert plain.scheduler.stats.num_preemptions > 0
    assert reserved.scheduler.stats.num_preemptions == 0
    assert summary([reserved])["recomputed"] == 0


def test_every_policy_finishes_jittered_runs_with_counts():
    for policy in POLICIES.values():
        runs = [replay(policy, SMALL, seed) for seed in (1, 2)]
        row = summary(runs)
        assert row["first_steps"][0] >= 1 and row["short_steps"][0] >= 1
        assert row["recomputed"] >= 0 and row["prefix_lost"] >= 0
        for run in runs:
            assert (
                run.scheduler.block_manager.num_free_blocks == run.scheduler.cache_config.num_blocks
            )
