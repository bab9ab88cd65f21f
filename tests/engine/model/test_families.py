"""Every family beyond Llama / Qwen2 greedy-equal to transformers' `generate`, token for token:
roomy, on the CPU backend's C kernels, under preemption and under chunked prefill. Windows of
8 tokens and prompts of up to 41 make the sliding layers slide."""

import pytest
import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.kv.kv_groups import kv_groups
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model.rope import inverse_frequencies
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError
from transformers import AutoModelForCausalLM

from tests import model_families
from tests.engine.model.test_parity import (
    MAX_TOKENS,
    assert_all_free,
    experts_packed,
    hf_greedy,
    make_prompts,
    run_engine,
)

FAMILIES = {
    "qwen3": model_families.build_qwen3,
    "gemma2": model_families.build_gemma2,
    "gemma3_text": model_families.build_gemma3,
    "mistral": model_families.build_mistral,
    "phi3": model_families.build_phi3,
    "mixtral": model_families.build_mixtral,
    "qwen3_moe": model_families.build_qwen3_moe,
    "gpt_oss": model_families.build_gpt_oss,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_one_batch_matches_transformers(family):
    """The torch backend: routed experts on the twin, `fused_moe_ref`."""
    path, prompts, expected = family
    llm, got = run_engine(path, prompts, num_blocks=128)
    assert experts_packed(llm) <= {False}
    assert got == expected
    assert_all_free(llm)


def test_cpu_backend_matches_transformers(family):
    """The CPU backend: float32 routed experts stay on the twin (packing them measured slower;
    bf16 ones run packed: test_bf16.py)."""
    path, prompts, expected = family
    llm, got = run_engine(path, prompts, num_blocks=128, attention_backend="cpu", device="cpu")
    assert experts_packed(llm) <= {False}
    assert got == expected
    assert_all_free(llm)


def test_preemption_keeps_tokens_exact(family):
    """10 blocks of every layer: with sliding and full layers (two KV groups of one layer
    each), blocks hold half as much, so the same bytes are 20 blocks."""
    path, prompts, expected = family
    config = ModelConfig.from_path(path)
    num_groups = kv_groups(config.layer_windows, config.num_layers).num_groups
    llm, got = run_engine(path, prompts, num_blocks=10 * num_groups, enable_prefix_caching=False)
    assert llm.stats()["num_preemptions"] > 0
    assert got == expected
    assert_all_free(llm)


def test_chunked_prefill_keeps_tokens_exact(family):
    path, prompts, expected = family
    llm, got = run_engine(path, prompts, num_blocks=128, max_num_batched_tokens=6, max_num_seqs=4)
    assert got == expected
    assert_all_free(llm)


def test_phi3_longrope_short_and_long_sequences_in_one_batch(tmp_path):
    """A 32-token pre-training length: prompts of 33 and 41 tokens run on the long factors,
    sequences that end within 32 tokens on the short ones, side by side in one batch. (One
    growing across 32 is not exact: transformers recomputes its cache there; rope.py.)"""
    path = model_families.build_phi3(tmp_path, original_length=32)
    prompts = [p for p in make_prompts() if len(p) + 12 <= 32 or len(p) > 32]
    assert len(prompts) == 12  # 1-17 tokens, and 33 and 41
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        num_blocks=64,
        attention_backend="cpu",
        device="cpu",
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 12)
    assert_all_free(llm)


def test_gemma2_logprobs_match_the_soft_capped_logits(tmp_path):
    """Final soft-capping never moves the argmax, so greedy tokens cannot see it: the
    first token's top log-probs are transformers' log_softmax of the capped logits."""
    path = model_families.build_gemma2(tmp_path, final_logit_softcapping=2.0)
    prompt = make_prompts()[-1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert logits.abs().max() < 2.0  # the cap is active
    want = torch.log_softmax(logits, dim=-1).topk(5)
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        num_blocks=32,
        attention_backend="cpu",
        device="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    first = llm.generate([prompt], params)[0].outputs[0].logprobs[0]  # greedy: sampled = top 1
    assert list(first) == want.indices.tolist()
    got = torch.tensor([entry.logprob for entry in first.values()])
    torch.testing.assert_close(got, want.values, atol=1e-5, rtol=0)
    assert_all_free(llm)


def test_mistral_window_no_longer_caps_the_model_length(tmp_path):
    """The window (8) used to cap max_model_len; now the model's 1024 positions are served."""
    path = model_families.build_mistral(tmp_path)
    assert ModelConfig.from_path(path).sliding_window == model_families.WINDOW
    llm = LLM(str(path), dtype="float32", block_size=8, num_blocks=64, attention_backend="torch")
    assert llm.executor.config.max_model_len == 1024
    prompt = make_prompts()[-1]  # 41 tokens, then 40 more: ten windows
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))
    assert out[0].outputs[0].token_ids == hf_greedy(path, [prompt], 40)[0]
    assert_all_free(llm)


def test_unknown_family_is_a_typed_error_naming_the_supported_ones(tmp_path):
    raw = {"model_type": "falcon", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1}  # fmt: skip
    with pytest.raises(CheckpointError, match="'falcon' is not supported; supported: llama,"):
        ModelConfig.from_dict(raw)
    with pytest.raises(CheckpointError, match="gemma3_text, phi3, mixtral"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "build",
    [model_families.build_gemma2, model_families.build_qwen3_moe, model_families.build_gpt_oss],
)
def test_triton_backend_windows_soft_caps_and_experts(build, tmp_path):
    """The Triton kernels (interpreted on CPU) in the engine: Gemma 2's window and attention
    soft-cap in paged attention, Qwen3-MoE's experts in the grouped MoE kernel, gpt-oss's
    sinks beside its windows (its biased experts on the twin); chunked."""
    path = build(tmp_path)
    prompts = make_prompts()[-5:-1]  # 23-33 tokens: past the 8-token window
    llm = LLM(str(path), dtype="float32", block_size=8, num_blocks=64,
              attention_backend="triton", max_num_batched_tokens=16)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 6)
    assert_all_free(llm)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_rank_holds_what_kv_size_counts(name, tmp_path):
    """kv-size's weight bytes per rank equal what a rank of 1 and of 2 holds and reads (the
    float32 checkpoint); in bf16 what it holds (Gemma's norms stay float32)."""
    path = FAMILIES[name](tmp_path)
    config = ModelConfig.from_path(path)
    for dtype, rank, size in ((torch.float32, 0, 1), (torch.float32, 1, 2), (torch.bfloat16, 1, 2)):
        decoder = Decoder(config, dtype, 64, get_kernel_ops("torch"), Shard.of(config, rank, size))
        read = load_weights(decoder, path)
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        assert held == weight_bytes_per_rank(config, dtype, size)
        if dtype == torch.float32:  # the checkpoint's own dtype
            assert read == held


def test_hub_style_configs_parse_as_transformers_reads_them():
    """Checkpoints on the Hub predate transformers 5's rope_parameters / layer_types: Gemma 3
    with rope_local_base_freq, sliding_window_pattern and a global linear scaling; Qwen3 with
    a window only past max_window_layers; Phi-3-mini-4k's window of 2047 on every layer."""
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
            "num_hidden_layers": 7}  # fmt: skip
    gemma3 = ModelConfig.from_dict({
        **base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 6, "sliding_window": 512, "query_pre_attn_scalar": 4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "attn_logit_softcapping": 50.0,
    })  # fmt: skip
    assert gemma3.layer_windows == (512,) * 5 + (0, 512)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert gemma3.attn_logit_softcapping is None  # transformers' Gemma 3 never applies it
    assert gemma3.attention_scale == 0.5 and gemma3.qk_norm and gemma3.gemma_norms
    qwen3 = ModelConfig.from_dict({**base, "model_type": "qwen3", "use_sliding_window": True,
                                   "sliding_window": 64, "max_window_layers": 4})  # fmt: skip
    assert qwen3.layer_windows == (0,) * 4 + (64,) * 3
    phi3 = ModelConfig.from_dict({**base, "model_type": "phi3", "sliding_window": 2047})
    assert phi3.layer_windows == (2047,) * 7 and phi3.rope_scaling is None
    moe = ModelConfig.from_dict({**base, "model_type": "qwen3_moe", "num_experts": 4,
                                 "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                 "moe_intermediate_size": 4})  # fmt: skip
    assert moe.sparse_layers == (False, True, False, False, False, True, False)
    assert not moe.norm_topk_prob
    mixtral = ModelConfig.from_dict({**base, "model_type": "mixtral", "num_local_experts": 4})
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 8


@pytest.mark.parametrize("truncate", [False, True])
def test_gpt_oss_hub_config_parses_as_transformers_reads_it(truncate):
    """gpt-oss-20b's config.json style: `rope_scaling` and `rope_theta` beside it, no
    `layer_types` (transformers alternates, sliding first); the YaRN table equals transformers'
    own (inverse frequencies and the cos / sin scale), the ramp truncated or not."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "truncate": truncate, "original_max_position_embeddings": 4096}  # fmt: skip
    raw = {"model_type": "gpt_oss", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 32,
           "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "sliding_window": 128, "num_local_experts": 4,
           "rope_theta": 150000.0, "rope_scaling": scaling,
           "max_position_embeddings": 131072}  # fmt: skip
    config = ModelConfig.from_dict(raw)
    hf = GptOssConfig(**raw)
    windows = tuple(128 if kind == "sliding_attention" else 0 for kind in hf.layer_types)
    assert config.layer_windows == windows == (128, 0, 128, 0, 128)
    assert config.rope_theta == 150000.0 and config.attention_bias and config.o_proj_bias
    want_inv_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv_freq, scale = inverse_frequencies(config)
    torch.testing.assert_close(inv_freq, want_inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)
