"""Every family on configs unlike the other tests' (other seeds, odd head counts, head_dim not
hidden / heads, 3-5 layers, other windows, expert counts and routing), greedy-equal to
transformers: roomy on the C kernels, and on a cache small enough to preempt. Windows of 5-13
tokens slide far within the 41-token prompts, so sliding groups free blocks as they go."""

import pytest
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.model_config import ModelConfig

from tests import model_families as fam
from tests.engine.model.test_parity import (
    MAX_TOKENS,
    assert_all_free,
    experts_packed,
    hf_greedy,
    make_prompts,
    run_engine,
)
from tests.models import build_llama, build_qwen2

S, F = "sliding_attention", "full_attention"
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 5000.0,
             "short_factor": [1.0 + 0.2 * i for i in range(4)],
             "long_factor": [1.0 + 0.7 * i for i in range(4)]}  # fmt: skip

# YaRN with transformers' defaults: truncated ramp, beta 32 / 1, factor = 1024 / 32
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 32.0,
                "original_max_position_embeddings": 32}  # fmt: skip

VARIANTS = {
    "llama": lambda p: build_llama(
        p, seed=41, num_attention_heads=8, num_key_value_heads=4, head_dim=12,
        num_hidden_layers=3,
    ),
    "qwen2": lambda p: build_qwen2(p, seed=42, num_attention_heads=2, num_key_value_heads=2,
                                   num_hidden_layers=3, layer_types=[F] * 3),
    "qwen3": lambda p: fam.build_qwen3(
        p, seed=43, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=3, tie_word_embeddings=False,
    ),
    "gemma2": lambda p: fam.build_gemma2(
        p, seed=44, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
        query_pre_attn_scalar=16, sliding_window=5, num_hidden_layers=3,
        attn_logit_softcapping=3.0,
    ),
    "gemma3_text": lambda p: fam.build_gemma3(
        p, seed=45, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        sliding_window=6, num_hidden_layers=5, layer_types=[S, S, F, S, F],
    ),
    "mistral": lambda p: fam.build_mistral(
        p, seed=46, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        sliding_window=11, num_hidden_layers=3,
    ),
    "phi3": lambda p: fam.build_phi3(
        p, seed=47, num_attention_heads=8, num_key_value_heads=4, rope_parameters=PHI3_ROPE,
        sliding_window=13, num_hidden_layers=3,
    ),
    "mixtral": lambda p: fam.build_mixtral(
        p, seed=48, num_local_experts=5, num_experts_per_tok=3, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=12, num_hidden_layers=3,
    ),
    "qwen3_moe": lambda p: fam.build_qwen3_moe(
        p, seed=49, num_experts=4, num_experts_per_tok=3, norm_topk_prob=True,
        mlp_only_layers=[], decoder_sparse_step=2, head_dim=24, num_hidden_layers=3,
    ),
    "gpt_oss": lambda p: fam.build_gpt_oss(
        p, seed=50, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
        num_hidden_layers=3, layer_types=[F, S, S], sliding_window=5, num_local_experts=5,
        num_experts_per_tok=3, intermediate_size=24, swiglu_limit=3.0, rope_parameters=GPT_OSS_ROPE,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(VARIANTS))
def test_variant_matches_transformers_roomy_and_preempted(family, tmp_path):
    path = VARIANTS[family](tmp_path)
    config = ModelConfig.from_path(path)
    assert config.model_type == family
    prompts = make_prompts(seed=9)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm, got = run_engine(path, prompts, num_blocks=256, attention_backend="cpu")
    assert experts_packed(llm) <= {False}  # float32 experts stay on the twin
    assert got == expected
    assert_all_free(llm)
    # 10 blocks' worth of every layer's bytes: the groups split the same memory
    num_groups = kv_groups(config.layer_windows, config.num_layers).num_groups
    small = dict(num_blocks=10 * num_groups, enable_prefix_caching=False)
    llm, got = run_engine(path, prompts, max_num_batched_tokens=16, **small)
    assert llm.stats()["num_preemptions"] > 0
    assert got == expected
    assert_all_free(llm)
