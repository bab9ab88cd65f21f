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

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model.test_granite_hybrid import assert_slots_free, greedy
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_granite_hybrid, build_qwen3_next

SWAP_SPACE = 1 << 20  # room for every sequence's blocks and state
# attention-heavy variants with small recurrent states: a host row costs less than a block,
# so a small CPU pool (blocks reach the disk) still keeps a snapshot per evicted block
LIGHT_STATE = {
    "granite": dict(
        num_hidden_layers=4, layer_types=["mamba", "attention", "attention", "attention"],
        mamba_n_heads=2, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
    ),
    "qwen3_next": dict(
        num_hidden_layers=4, full_attention_interval=4, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
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
