"""Recurrent state through swap preemption and the prefix cache's CPU and disk tiers, on both
recurrent families (granitemoehybrid: Mamba2; qwen3_next: gated DeltaNet), fp32, greedy-equal
to transformers' `generate`:
- swap preemption with small caches carries each sequence's state through host rows
  (engine/kv/host_states.py): forced swap, every preemption a swap, none recomputed;
- a prompt's blocks evicted from the device to the CPU tier, and on to the disk tier, take
  their state snapshots along: the prompt again hits >= 32 tokens there, with the same output.
Every block, state slot and host row is free after each run."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.kv.block_hash import prompt_block_hashes

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model.hybrid_checks import assert_slots_free, greedy
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_granite_hybrid, build_qwen3_next

SWAP_SPACE = 1 << 20  # room for every sequence's blocks and state
# attention-heavy variants with small recurrent states: a host row costs less than a block,
# so a small CPU pool (blocks reach the disk) still keeps a snapshot per evicted block
LIGHT_STATE = {
    "granite": dict(
        num_hidden_layers=5, num_key_value_heads=4, mamba_n_groups=1, mamba_d_state=2,
        layer_types=["mamba", "attention", "attention", "attention", "attention"],
    ),
    "qwen3_next": dict(
        num_key_value_heads=4, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "full_attention", "full_attention"],
    ),
}  # fmt: skip
BUILDERS = {"granite": build_granite_hybrid, "qwen3_next": build_qwen3_next}


@pytest.fixture(scope="module", params=["granite", "qwen3_next"])
def family(request, tmp_path_factory):
    name = request.param
    path = BUILDERS[name](tmp_path_factory.mktemp(name))
    prompts = make_prompts()
    return name, path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def assert_state_free(llm) -> None:
    """Blocks and state slots free (assert_slots_free), and no host row held."""
    assert_slots_free(llm)
    manager = llm.scheduler.block_manager
    assert not manager.host_swap.owner, manager.host_swap.owner
    host = manager.snapshots.host if manager.snapshots is not None else None
    assert host is None or not host.used_this_step


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swap_preemption_carries_the_state(family, prefix_caching):
    _, path, prompts, expected = family
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4, preemption_mode="swap",
        swap_space=SWAP_SPACE, enable_prefix_caching=prefix_caching,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0, stats
        assert stats["num_swap_preemptions"] == stats["num_preemptions"], stats  # none recomputed
        host_swap = llm.scheduler.block_manager.host_swap
        assert host_swap.num_swapped_out == stats["num_swap_preemptions"]
        assert_state_free(llm)


def generate_one(llm, prompt: list[int], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_a_prefix_on_the_cpu_tier_resumes_from_its_snapshot(family):
    """The device pool evicts a 64-token prompt's blocks into the CPU tier, their snapshots
    into host rows; the prompt again hits 56 tokens there, with transformers' output."""
    _, path, _, _ = family
    prompt, *others = random_prompts([64, 64, 64], seed=31)
    expected = hf_greedy(path, [prompt], MAX_TOKENS)[0]
    with make_llm(path, num_blocks=16, max_num_seqs=16, swap_space=SWAP_SPACE) as llm:
        assert generate_one(llm, prompt).outputs[0].token_ids == expected
        for other in others:
            generate_one(llm, other)
        manager = llm.scheduler.block_manager
        hashes = prompt_block_hashes(prompt, 8)[:7]
        assert not any(h in manager.cached for h in hashes)  # all on the CPU tier
        assert all(h in manager.cpu.cached for h in hashes)
        assert manager.snapshots.host.num_held > 0
        again = generate_one(llm, prompt)
        assert again.outputs[0].token_ids == expected
        assert again.num_cached_tokens == 56 and again.cached_tokens_by_tier == {"cpu": 56}
        stats = llm.stats()
        assert stats["host_state_snapshot_hits"] == 1, stats
        assert stats["host_state_snapshot_bytes"] > 0, stats
        assert_state_free(llm)


@pytest.fixture(scope="module", params=["granite", "qwen3_next"])
def light_state(request, tmp_path_factory):
    """A family's attention-heavy variant (LIGHT_STATE), and its bytes per KV block."""
    name = request.param
    path = BUILDERS[name](tmp_path_factory.mktemp(name + "_light"), **LIGHT_STATE[name])
    return path


def test_a_prefix_on_the_disk_tier_resumes_from_its_snapshot(light_state, tmp_path):
    """A small CPU pool passes the prompt's blocks on to the disk tier; their snapshots stay
    in host rows keyed by the block hash. The prompt again reads 56 tokens from disk and
    resumes from the deepest snapshot, with transformers' output."""
    path = light_state
    prompt, *others = random_prompts([64] * 7, seed=32)
    expected = hf_greedy(path, [prompt], 4)[0]
    # 200 KiB: the host rows come out of it (engine/kv/state_pool.py), 8 CPU blocks remain
    with make_llm(
        path, num_blocks=16, max_num_seqs=16, swap_space=200 << 10, kv_disk_dir=str(tmp_path),
        kv_disk_bytes=1 << 24, kv_disk_key_file=str(tmp_path.parent / "kv-disk.key"),
    ) as llm:  # fmt: skip
        manager = llm.scheduler.block_manager
        hashes = prompt_block_hashes(prompt, 8)[:7]
        assert generate_one(llm, prompt, 4).outputs[0].token_ids == expected
        for other in others:
            generate_one(llm, other, 4)
            if not any(h in manager.cached or h in manager.cpu.cached for h in hashes):
                break
        assert all(h in manager.disk.on_disk for h in hashes)
        assert not any(h in manager.cached or h in manager.cpu.cached for h in hashes)
        again = generate_one(llm, prompt, 4)
        assert again.outputs[0].token_ids == expected
        assert again.num_cached_tokens == 56 and again.cached_tokens_by_tier == {"disk": 56}
        assert llm.stats()["host_state_snapshot_hits"] == 1
        assert_state_free(llm)
