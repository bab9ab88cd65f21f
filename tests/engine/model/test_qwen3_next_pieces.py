"""A tiny Qwen3-Next causal LM assembled from kvpager's pieces (tests/engine/model/
qwen3_next_model.py) equals transformers' Qwen3NextForCausalLM in fp32: every position's
logits over a whole prompt, and over the same prompt prefilled in chunks and then decoded token
by token through the DeltaNet state slots and the paged caches. Also: the family switches read
from its config."""

import pytest
import torch
from kvpager.engine.families.qwen3_next import qwen3_next_fields
from kvpager.engine.model_families import family_fields
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from tests.engine.model.qwen3_next_model import TinyQwen3Next


def hf_model(seed: int = 0) -> Qwen3NextForCausalLM:
    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        mlp_only_layers=[1], full_attention_interval=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3))
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p).log())
    return model


@pytest.fixture(scope="module")
def models():
    model = hf_model()
    prompt = torch.randint(0, 64, (14,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(prompt[None]).logits[0]
    return model, prompt, expected


def test_whole_prompt_equals_transformers(models):
    model, prompt, expected = models
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    ours = TinyQwen3Next(model)
    torch.testing.assert_close(ours.forward(prompt, 0), expected, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decode_equal_transformers(models):
    model, prompt, expected = models
    ours = TinyQwen3Next(model)
    pieces = [(0, 3), (3, 9), *((i, i + 1) for i in range(9, 14))]
    logits = torch.cat([ours.forward(prompt[s:e], s) for s, e in pieces])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert not ours.states.ssm[:, 0].any()  # the other slot untouched


def test_family_switches_read_from_the_config(models):
    model = models[0]
    raw = {**model.config.to_dict(), "model_type": "qwen3_next"}
    common, own = family_fields(raw), qwen3_next_fields(raw)
    assert common["qk_norm"] and common["partial_rotary_factor"] == 0.25
    assert common["sparse_layers"] == (True, False, True, True)
    assert common["num_experts"] == 4 and common["moe_intermediate_size"] == 12
    assert own["recurrent_layers"] == (True, False, True, False)
    assert own["shared_expert_intermediate_size"] == 20
    assert own["deltanet_dims"].conv_dim == 2 * 16 + 32
