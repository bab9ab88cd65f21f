"""DeepSeek V3 greedy-equal to transformers' `generate` in fp32, token for token
(tests/model_families.py: build_deepseek_v3): multi-head latent attention over latent pages
(one latent and one rotary key per token, nothing per head), grouped sigmoid MoE with a
shared expert; a second config with one q_proj, rotate-half RoPE, YaRN with mscale_all_dim,
no renormalisation, two shared experts. Roomy, under preemption, in small prefill chunks;
the absorbed decode against the up-projected reference; every run ends all free."""

import json

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.kernels.reference_mla import mla_decode_ref, mla_prefill_ref

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.model.test_bf16 import MAX_TOKENS as BF16_TOKENS
from tests.engine.model.test_bf16 import assert_follows_transformers
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_deepseek_v2, build_deepseek_v3


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = build_deepseek_v3(tmp_path_factory.mktemp("deepseek-v3"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def deepseek_variant(tmp_path_factory):
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}  # fmt: skip
    path = build_deepseek_v3(
        tmp_path_factory.mktemp("deepseek-v3-variant"), seed=13, q_lora_rank=None,
        rope_interleave=False, rope_parameters=rope, norm_topk_prob=False, n_group=2,
        topk_group=1, n_shared_experts=2, first_k_dense_replace=0, num_experts_per_tok=3,
    )  # fmt: skip
    prompts = random_prompts([3, 17, 30, 45], seed=4)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.fixture(scope="module", params=["group_limited_greedy", "greedy"])
def deepseek_v2(tmp_path_factory, request):
    overrides = {} if request.param == "group_limited_greedy" else dict(
        topk_method="greedy", q_lora_rank=None, num_experts_per_tok=3, first_k_dense_replace=0
    )  # fmt: skip
    path = build_deepseek_v2(tmp_path_factory.mktemp("deepseek-v2"), **overrides)
    prompts = random_prompts([2, 11, 26, 40], seed=6)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_deepseek_v2_matches_transformers(deepseek_v2):
    """V2: its softmax router, group-limited or greedy, and its complex (adjacent-pair) RoPE;
    roomy and preempted with 6-token chunks."""
    path, prompts, expected = deepseek_v2
    config = ModelConfig.from_path(path)
    assert config.mla and config.moe_router == "deepseek_v2" and config.rope_interleaved
    with make_llm(path) as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)
    with make_llm(path, num_blocks=12, max_num_batched_tokens=6) as llm:
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    assert load_weights(decoder, path) == weight_bytes_per_rank(config, torch.float32)


def test_config_reads_latent_attention(deepseek):
    config = ModelConfig.from_path(deepseek[0])
    assert config.mla and config.num_kv_heads == 1 and config.head_dim == 8
    assert config.cache_head_dim == (24 + 8) // 2
    assert config.sparse_layers == (False, True, True) and config.expert_groups == (4, 2)
    assert config.kv_bytes_per_token("float32") == 3 * (24 + 8) * 4  # one row a layer
    config.check_tensor_parallel(2)  # heads split: tests/engine/worker/test_tensor_parallel_mla.py


def test_greedy_matches_transformers(deepseek):
    path, prompts, expected = deepseek
    with make_llm(path) as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)


def test_preemption_and_small_chunks_stay_exact(deepseek):
    path, prompts, expected = deepseek
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=5, enable_prefix_caching=False
    ) as llm:
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


def test_latent_blocks_swap_fork_and_hit_the_prefix_cache(deepseek):
    """Latent pages move as any block: swap preemption copies them out and back, a second
    run of the prompts hits their full blocks, n = 3 greedy samples fork the table
    (copy-on-write of the shared tail); all equal to transformers."""
    path, prompts, expected = deepseek
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4, preemption_mode="swap",
        swap_space=1 << 20, enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0 and stats["num_swapped_in_blocks"] > 0
        assert_all_free(llm)
    with make_llm(path, num_blocks=256) as llm:
        assert greedy(llm, prompts) == expected
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        assert greedy(llm, prompts[-3:]) == expected[-3:]
        assert llm.stats()["prefix_cache_hit_tokens"] > hits_before
        out = llm.generate(
            [prompts[-2]], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
        )[0]
        assert [c.token_ids for c in out.outputs] == [expected[-2]] * 3
        assert llm.stats()["num_block_copies"] > 0
        assert_all_free(llm)


def test_a_second_config_matches_transformers(deepseek_variant):
    path, prompts, expected = deepseek_variant
    config = ModelConfig.from_path(path)
    assert config.q_lora_rank == 0 and not config.rope_interleaved and all(config.sparse_layers)
    with make_llm(path, attention_backend="cpu") as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)
    with make_llm(path, num_blocks=14, max_num_batched_tokens=7) as llm:
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


def test_absorbed_decode_equals_the_up_projected_reference():
    """Every query of a 37-token context (one at a time, as decode, and all together as a
    chunk) attends the same through the absorbed W_UK / W_UV as through per-head K / V."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, latent_rank, v_dim, num_keys = 4, 16, 8, 24, 16, 37

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q_nope, q_pe = rand(num_keys, heads, nope), rand(num_keys, heads, rope)
    latent, k_pe = rand(num_keys, latent_rank), rand(num_keys, rope)
    w_uk, w_uv = rand(heads, nope, latent_rank), rand(heads, v_dim, latent_rank)
    args = (w_uk, w_uv, 0.2)
    whole = mla_prefill_ref(q_nope, q_pe, latent, k_pe, *args)
    for t in (0, 1, 20, num_keys - 1):
        one = slice(t, t + 1)
        keys = slice(0, t + 1)
        absorbed = mla_decode_ref(q_nope[one], q_pe[one], latent[keys], k_pe[keys], *args)
        up = mla_prefill_ref(q_nope[one], q_pe[one], latent[keys], k_pe[keys], *args)
        torch.testing.assert_close(absorbed, up, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(absorbed, whole[one], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixture", ["deepseek", "deepseek_variant"])
def test_weights_are_what_kv_size_counts(fixture, request):
    path = request.getfixturevalue(fixture)[0]
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, path)
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)


# DeepSeek-V3's config.json (671B), its architecture fields
V3_SHAPE = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
                intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000,
                rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                              "type": "yarn"},
                torch_dtype="bfloat16")  # fmt: skip


def test_latent_pages_are_what_kv_size_counts(tmp_path, capsys):
    """A DeepSeek-V3-shaped config holds 61 layers x (512 + 64) bf16 per token: 70,272
    bytes, against 4,997,120 for its per-head K (192) and V (128) of 128 heads (71x) and
    249,856 for a GQA cache of 8 KV heads of 128 (3.6x). Its softmax scale is transformers'
    (YaRN's mscale_all_dim folded in)."""
    from kvpager.services.cli import main
    from transformers.modeling_rope_utils import yarn_apply_mscale

    config = ModelConfig.from_dict(V3_SHAPE)
    assert config.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70_272
    per_head = {**V3_SHAPE, "model_type": "llama", "head_dim": (192 + 128) // 2}
    assert ModelConfig.from_dict(per_head).kv_bytes_per_token("bf16") == 4_997_120
    gqa = {**V3_SHAPE, "model_type": "llama", "head_dim": 128, "num_key_value_heads": 8}
    assert ModelConfig.from_dict(gqa).kv_bytes_per_token("bf16") == 249_856
    want = yarn_apply_mscale({**V3_SHAPE["rope_scaling"], "rope_type": "yarn"}, 192**-0.5)
    assert config.attention_scale == pytest.approx(want, rel=1e-12)
    (tmp_path / "config.json").write_text(json.dumps(V3_SHAPE))
    assert main(["kv-size", str(tmp_path), "--tokens", "65536", "--dtype", "bf16"]) == 0
    assert "KV bytes per token:        70,272 (bfloat16)" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_latents_in_an_fp8_cache(deepseek, backend):
    """kv_cache_dtype fp8: the latent pages hold e4m3 latents (4x a float32 cache's blocks in
    the same bytes) and greedy follows the float32 cache for most tokens (on the torch twin,
    and on the C kernel reading the e4m3 pages in place). Not vLLM's top-5
    check: a latent's rounding reaches every head's key, and on this random model (top
    tokens within ~0.5 nats) the 3-token prompt's first token already differs (seen: 0, 0,
    5, 12 and 4 tokens agreed of 12); a misread cache agrees on none."""
    from tests.engine.worker.test_fp8_cache import BUDGET, PARAMS

    path = deepseek[0]
    prompts = random_prompts([3, 9, 17, 30, 45], seed=11)
    fp8_llm = make_llm(path, kv_cache_dtype="fp8", attention_backend=backend, **BUDGET)
    with make_llm(path, **BUDGET) as full, fp8_llm as fp8:
        assert fp8.executor.kv_cache.dtype == torch.float8_e4m3fn
        assert fp8.executor.num_blocks // 4 == full.executor.num_blocks  # 1 MiB each
        expected, got = full.generate(prompts, PARAMS), fp8.generate(prompts, PARAMS)
        agreed = [_agreed(ref.outputs[0].token_ids, out.outputs[0].token_ids)
                  for ref, out in zip(expected, got)]  # fmt: skip
        assert sum(agreed) >= 2 * len(prompts) and sum(n > 0 for n in agreed) >= 3, agreed
        assert_all_free(full)
        assert_all_free(fp8)


def _agreed(expected: list[int], got: list[int]) -> int:
    """Tokens equal before the first difference."""
    same = [a == b for a, b in zip(expected, got)]
    return same.index(False) if False in same else len(same)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_greedy_follows_transformers(deepseek, backend):
    """bf16 (routers in fp32, as transformers keeps them): each greedy token within
    test_bf16.py's tie margin of transformers' bf16 best, up to the first near tie."""
    path = deepseek[0]
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    with make_llm(path, dtype="bfloat16", attention_backend=backend) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_follows_transformers(path, prompts, outputs)
        assert_all_free(llm)


def test_triton_backend(deepseek):
    """The Triton latent attention kernel (kernels/mla_attention.py), its grouped MoE and
    cache write, interpreted on the CPU: decode tokens and 16-token prefill chunks."""
    path = deepseek[0]
    chosen = random_prompts([5, 21, 34], seed=9)
    with make_llm(path, attention_backend="triton", max_num_batched_tokens=16) as llm:
        assert llm.executor.ops.mla_attention.__module__.endswith("mla_attention")
        assert greedy(llm, chosen, 6) == hf_greedy(path, chosen, 6)
        assert_all_free(llm)
