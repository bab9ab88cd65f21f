"""Qwen3-Next (`qwen3_next`) over two gloo ranks (engine/model/qwen3_next/sharded.py): the
gated DeltaNet split by key heads and their value heads, gated attention by heads, the
shared-expert MoE by intermediate rows. Greedy-equal to transformers in fp32, roomy, in
prefill chunks with a prefix snapshot hit on a repeated 64-token prompt, n = 3 forks and
recompute preemption; each rank's state slots hold only its heads; every block and state slot
is free after each run."""

import dataclasses

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
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
from tests.model_families import build_qwen3_next

PROMPTS = random_prompts([1, 4, 9, 17, 26, 38], seed=41)
REPEATED = random_prompts([64], seed=42)[0]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """Not the single-rank tests' model: another seed, 4 key heads of 8 value heads."""
    path = build_qwen3_next(
        tmp_path_factory.mktemp("qwen3-next-tp"), seed=43, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    return path, hf_greedy(path, PROMPTS), hf_greedy(path, [REPEATED])[0]


def test_heads_split_roomy_chunked_hits_forks_and_preempted(qwen3_next):
    path, expected, repeated = qwen3_next
    config = ModelConfig.from_path(path)
    with tp_llm(path, max_num_batched_tokens=6, max_num_seqs=4) as llm:
        states = llm.executor.state_cache.states
        assert states.ssm.shape[2] == config.deltanet_dims.num_value_heads // 2
        assert greedy(llm, PROMPTS) == expected
        assert greedy(llm, [REPEATED]) == [repeated]
        second = llm.generate([REPEATED], SamplingParams(temperature=0.0, max_tokens=16))[0]
        assert second.outputs[0].token_ids == repeated
        assert second.num_cached_tokens == 56  # 7 of its 8 blocks: the last token is computed
        out = llm.generate(PROMPTS[3:4], SamplingParams(n=3, temperature=0.0, max_tokens=8))
        assert [c.token_ids for c in out[0].outputs] == [expected[3][:8]] * 3
        assert_slots_free(llm)
    with tp_llm(
        path, num_blocks=10, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute",
    ) as llm:  # fmt: skip
        assert greedy(llm, PROMPTS) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)


def test_each_rank_reads_its_heads(qwen3_next):
    path = qwen3_next[0]
    config = ModelConfig.from_path(path)
    ops = get_kernel_ops("torch")
    for rank in (0, 1):
        decoder = Decoder(config, torch.float32, 64, ops, Shard.of(config, rank, 2))
        read = load_weights(decoder, path)
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        assert read == held == weight_bytes_per_rank(config, torch.float32, 2)
        mixer = decoder.layers[0].mixer
        assert mixer.dims.num_key_heads == 2 and mixer.dims.num_value_heads == 4
    assert held < weight_bytes_per_rank(config, torch.float32, 1)


def test_key_heads_that_do_not_split_are_refused(qwen3_next):
    config = ModelConfig.from_path(qwen3_next[0])
    dims = dataclasses.replace(config.deltanet_dims, num_key_heads=3, num_value_heads=6)
    with pytest.raises(ConfigError, match="2 does not divide the DeltaNet key heads"):
        Shard.of(dataclasses.replace(config, deltanet_dims=dims), 0, 2)
