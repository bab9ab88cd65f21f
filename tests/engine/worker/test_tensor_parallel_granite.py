"""Granite 4 hybrids (`granitemoehybrid`) over two gloo ranks, Mamba2 mixers split by SSM
heads (engine/model/sharding.py, Mamba2Shard): greedy-equal to transformers in fp32, roomy, in
prefill chunks (a chunk resumes from the state the last one left), with a prefix snapshot hit on a
repeated 64-token prompt, n = 3 forks and recompute preemption. Two configs: two groups (one a
rank) with MoE, and one group (both ranks hold it, and the gated norm sums its squares across
them) with the shared MLP alone. Each rank's state slots hold only its heads; every block and
state slot is free after each run."""

import dataclasses

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model.recurrent import allocate_states
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import ConfigError

from tests.engine.helpers import random_prompts
from tests.engine.model.hybrid_checks import assert_slots_free
from tests.engine.worker.test_tensor_parallel import (  # noqa: F401 (an autouse fixture)
    greedy,
    hf_greedy,
    one_thread_per_rank,
    tp_llm,
)
from tests.model_families import build_granite_hybrid

PROMPTS = random_prompts([1, 4, 9, 17, 26, 38], seed=31)
REPEATED = random_prompts([64], seed=32)[0]


@pytest.fixture(scope="module")
def granite_moe(tmp_path_factory):
    """Not the single-rank tests' model: another seed, 4 heads in 2 groups, MoE."""
    path = build_granite_hybrid(tmp_path_factory.mktemp("granite-tp"), seed=33)
    return path, hf_greedy(path, PROMPTS), hf_greedy(path, [REPEATED])[0]


@pytest.fixture(scope="module")
def granite_one_group(tmp_path_factory):
    """One group for two ranks; no experts, no RoPE, attention first, 8 heads of 8."""
    path = build_granite_hybrid(
        tmp_path_factory.mktemp("granite-tp-1g"), seed=34, num_local_experts=0,
        position_embedding_type="nope", layer_types=["attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=12,
        mamba_chunk_size=8, mamba_proj_bias=True,
    )  # fmt: skip
    return path, hf_greedy(path, PROMPTS)


def test_heads_split_roomy_chunked_hits_and_forks(granite_moe):
    path, expected, repeated = granite_moe
    config = ModelConfig.from_path(path)
    with tp_llm(path, max_num_batched_tokens=6, max_num_seqs=4) as llm:
        states = llm.executor.state_cache.states
        assert states.ssm.shape[2] == config.mamba_dims.num_heads // 2  # this rank's heads
        assert greedy(llm, PROMPTS) == expected
        assert greedy(llm, [REPEATED]) == [repeated]
        before = llm.stats()
        second = llm.generate([REPEATED], SamplingParams(temperature=0.0, max_tokens=16))[0]
        assert second.outputs[0].token_ids == repeated
        assert second.num_cached_tokens == 56  # 7 of its 8 blocks: the last token is computed
        stats = llm.stats()
        assert stats["state_snapshot_hits"] - before["state_snapshot_hits"] == 1, stats
        out = llm.generate(PROMPTS[3:4], SamplingParams(n=3, temperature=0.0, max_tokens=8))
        assert [c.token_ids for c in out[0].outputs] == [expected[3][:8]] * 3
        assert_slots_free(llm)


def test_recompute_preemption_in_small_chunks(granite_moe):
    path, expected, _ = granite_moe
    with tp_llm(
        path, num_blocks=10, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute",
    ) as llm:  # fmt: skip
        assert greedy(llm, PROMPTS) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_swap_preemptions"] == 0, stats
        assert stats["state_snapshot_hits"] > 0, stats  # a preempted one resumes from its own
        assert_slots_free(llm)


def test_one_group_shared_by_both_ranks(granite_one_group):
    path, expected = granite_one_group
    with tp_llm(path) as llm:
        assert llm.executor.model.layers[1].mixer.shard.norm_span == 2
        assert greedy(llm, PROMPTS) == expected
        assert_slots_free(llm)
    with tp_llm(
        path, num_blocks=12, max_num_batched_tokens=5, max_num_seqs=3,
        preemption_mode="recompute", enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        assert greedy(llm, PROMPTS) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_slots_free(llm)


@pytest.mark.parametrize("variant", ["granite_moe", "granite_one_group"])
def test_each_rank_reads_its_heads(request, variant):
    """Bytes read = bytes held = what kv-size counts per rank; a state slot is the rank's
    heads' (the conv state: its x channels and its groups' B and C)."""
    path = request.getfixturevalue(variant)[0]
    config = ModelConfig.from_path(path)
    ops, whole = get_kernel_ops("torch"), config.mamba_dims
    for rank in (0, 1):
        decoder = Decoder(config, torch.float32, 64, ops, Shard.of(config, rank, 2))
        read = load_weights(decoder, path)
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        assert read == held == weight_bytes_per_rank(config, torch.float32, 2)
    assert held < weight_bytes_per_rank(config, torch.float32, 1)
    states = allocate_states(config, 3, torch.float32, "meta", world_size=2)
    groups = max(1, whole.num_groups // 2)
    assert states.conv.shape[2] == whole.intermediate_size // 2 + 2 * groups * whole.state_size
    assert states.ssm.shape[2:] == (whole.num_heads // 2, whole.head_dim, whole.state_size)


def test_mamba_heads_or_groups_that_do_not_split_are_refused(granite_moe):
    config = ModelConfig.from_path(granite_moe[0])
    dims = config.mamba_dims
    odd_heads = dataclasses.replace(config, mamba_dims=dataclasses.replace(dims, num_heads=6))
    with pytest.raises(ConfigError, match="4 does not divide the Mamba heads"):
        Shard.of(odd_heads, 0, 4)
    odd_groups = dataclasses.replace(config, mamba_dims=dataclasses.replace(dims, num_groups=3))
    with pytest.raises(ConfigError, match="neither divides nor is a multiple of the Mamba"):
        Shard.of(odd_groups, 0, 2)
