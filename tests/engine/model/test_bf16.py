"""A bfloat16 model: greedy tokens follow transformers' bf16 forward of the same weights, on
the C (cpu) and torch backends; a near tie may go the other way (different summation orders),
and the check ends there. On a CPU with native bf16 this runs oneDNN's packed bf16 linears,
and on the cpu backend the MoE models' experts too (engine/model/packed_experts.py). Gemma's
norms, each on its own, equal transformers' bit for bit."""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from transformers import AutoModelForCausalLM

from tests import model_families
from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.model.test_parity import experts_packed

MAX_TOKENS = 12
TIE_MARGIN = 0.1  # logits apart, ~3 bf16 steps at these magnitudes (seen: 0, 0.031, 0.062)
# transformers' Gemma norm modules of a layer -> the engine's weights (engine/model/loader.py)
GEMMA_NORMS = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "attn_output_norm",
    "pre_feedforward_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "mlp_output_norm",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
}


def hf_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced: transformers' logits for each output position, float32 [len, vocab]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


MODELS = [
    "tiny_llama",
    "tiny_qwen2",
    "tiny_gemma2",
    "tiny_gemma3",
    "tiny_qwen3_moe",
    "tiny_gpt_oss",
]


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return model_families.build_gemma2(tmp_path_factory.mktemp("gemma2"))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return model_families.build_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    return model_families.build_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """Sinks in bf16 (the cpu backend: the C decode kernel for short rows, bf16 SDPA with the
    sink column for chunks; head_dim 16 keeps the token-major layout, the tile kernel's sinks
    are tests/kernels/test_attention_sinks.py's), float32 norm weights beside bf16 rows, the
    biased experts on the twin. Smaller
    weights and biases than the float32 tests': with theirs transformers' own bf16 forward
    (scores, sinks and softmax in bf16) strays up to 0.88 from its fp32 one, past TIE_MARGIN;
    with these 0.04."""
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    return model_families.build_gpt_oss(path, bias_scale=0.3, initializer_range=0.1)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_greedy_follows_transformers(request, model_name, backend):
    path = request.getfixturevalue(model_name)
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    llm = make_llm(path, dtype="bfloat16", attention_backend=backend)
    assert llm.executor.dtype == torch.bfloat16
    moe = model_name == "tiny_qwen3_moe"  # its experts packed on the cpu backend
    packed = {backend == "cpu" and cpu_has_native_bf16()} if moe else set()
    assert experts_packed(llm) == ({False} if model_name == "tiny_gpt_oss" else packed)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_follows_transformers(path, prompts, outputs)
    assert_all_free(llm)


def assert_follows_transformers(path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Each greedy token within TIE_MARGIN of transformers' bf16 best, up to its first tie."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    agreed = 0
    for prompt, output in zip(prompts, outputs):
        for logits, token in zip(hf_logits(model, prompt, output), output):
            best = int(logits.argmax())
            assert logits[token] >= logits[best] - TIE_MARGIN, (token, best)
            if token != best:
                break  # a near tie went the other way: transformers' context differs from here
            agreed += 1
    assert agreed >= 2 * MAX_TOKENS  # of 4 x 12: the tiny random models have flat logits


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("model_name", ["tiny_gemma2", "tiny_gemma3"])
def test_bf16_gemma_norms_equal_transformers(request, model_name, backend):
    """Every (1 + w) norm, sandwich and q/k ones included, on the same bf16 rows: transformers
    scales in fp32 and rounds once; so does the engine, with (1 + w) kept in fp32 (rounded
    to bf16 at load, 23-40% of the outputs were a bf16 step or more apart)."""
    path = request.getfixturevalue(model_name)
    config = ModelConfig.from_path(path)
    ops = get_kernel_ops(backend)
    engine = Decoder(config, torch.bfloat16, 64, ops)
    load_weights(engine, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().model
    pairs = [(hf.norm, engine.norm)]
    for hf_layer, layer in zip(hf.layers, engine.layers, strict=True):
        for hf_name, name in GEMMA_NORMS.items():
            if getattr(layer, name) is not None:
                pairs.append((hf_layer.get_submodule(hf_name), getattr(layer, name)))
    assert len(pairs) == 1 + config.num_layers * (6 if config.qk_norm else 4)
    torch.manual_seed(0)
    for hf_norm, weight in pairs:
        x = (torch.randn(37, weight.shape[0]) * 3).bfloat16()
        with torch.no_grad():
            want = hf_norm(x)
        got = ops.add_rms_norm(x.clone(), None, weight, config.rms_norm_eps)[0]
        assert got.dtype == want.dtype == torch.bfloat16
        apart = float((got != want).float().mean())
        # the C sum of squares is torch's to ~1e-7, so a rare row may round the other way
        assert apart == 0.0 if backend == "torch" else apart < 0.01, (hf_norm, apart)
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=0)
