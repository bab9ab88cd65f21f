"""DeepSeek V3 / V2 latent attention over two gloo ranks (heads split): greedy-equal to
transformers in fp32, roomy and under preemption with small prefill chunks, n > 1 forks and
prefix hits; each rank keeps the whole latent page (the latent is every head's) and reads only
its heads' rows of q_b_proj / kv_b_proj and columns of o_proj, half of each MLP and expert.
Every run ends with all blocks free."""

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

from tests.engine.helpers import assert_all_free, random_prompts
from tests.engine.worker.test_tensor_parallel import (  # noqa: F401 (an autouse fixture)
    greedy,
    hf_greedy,
    one_thread_per_rank,
    tp_llm,
)
from tests.model_families import build_deepseek_v2, build_deepseek_v3

PROMPTS = random_prompts([1, 4, 9, 17, 26, 38], seed=21)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """Not the single-rank tests' model: another seed, one q_proj, rotate-half RoPE."""
    path = build_deepseek_v3(
        tmp_path_factory.mktemp("deepseek-v3-tp"), seed=23, q_lora_rank=None,
        rope_interleave=False, n_shared_experts=2,
    )  # fmt: skip
    return path, hf_greedy(path, PROMPTS)


def test_v3_heads_split_roomy_preempted_in_chunks_forks_and_hits(deepseek_v3):
    """The C kernel's backend (latent decode in C on each rank's heads)."""
    path, expected = deepseek_v3
    config = ModelConfig.from_path(path)
    with tp_llm(path, attention_backend="cpu") as llm:
        assert llm.executor.shard.num_heads == config.num_heads // 2
        assert llm.executor.kv_cache.shape[-1] == config.cache_head_dim  # the whole row half
        assert greedy(llm, PROMPTS) == expected
        assert greedy(llm, PROMPTS[-2:]) == expected[-2:]  # full blocks hit the prefix cache
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        out = llm.generate(PROMPTS[3:4], SamplingParams(n=3, temperature=0.0, max_tokens=8))
        assert [c.token_ids for c in out[0].outputs] == [expected[3][:8]] * 3
        assert_all_free(llm)
    with tp_llm(path, num_blocks=8, max_num_batched_tokens=8) as llm:
        assert greedy(llm, PROMPTS) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_v2_over_two_ranks(topk_method, tmp_path):
    path = build_deepseek_v2(tmp_path, seed=24, topk_method=topk_method)
    prompts = PROMPTS[1::2]
    with tp_llm(path, num_blocks=16, max_num_batched_tokens=7) as llm:
        assert greedy(llm, prompts) == hf_greedy(path, prompts)
        assert_all_free(llm)


def test_each_rank_reads_its_heads_and_the_whole_latent(deepseek_v3):
    path = deepseek_v3[0]
    config = ModelConfig.from_path(path)
    ops = get_kernel_ops("torch")
    whole = load_weights(Decoder(config, torch.float32, 64, ops), path)
    assert whole == weight_bytes_per_rank(config, torch.float32, 1)
    for rank in (0, 1):
        decoder = Decoder(config, torch.float32, 64, ops, Shard.of(config, rank, 2))
        read = load_weights(decoder, path)
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        assert read == held == weight_bytes_per_rank(config, torch.float32, 2) < whole
        mla = decoder.layers[0].mla
        assert mla.kv_a.shape[0] == config.kv_lora_rank + config.head_dim  # every head's
        assert mla.kv_b.shape[0] == 2 * (config.qk_nope_head_dim + config.v_head_dim)
        assert mla.o.shape[1] == 2 * config.v_head_dim


def test_heads_that_do_not_split_are_refused(deepseek_v3):
    config = ModelConfig.from_path(deepseek_v3[0])
    with pytest.raises(ConfigError, match="3 does not divide num_attention_heads 4"):
        Shard.of(config, 0, 3)
