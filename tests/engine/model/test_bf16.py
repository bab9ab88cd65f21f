"""A bfloat16 model: greedy tokens follow transformers' bf16 forward of the same weights, on
the C (cpu) and torch backends; a near tie may go the other way (different summation orders),
and the check ends there. On a CPU with native bf16 this runs oneDNN's packed bf16 linears,
and on the cpu backend the MoE models' experts too (engine/model/packed_experts.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.memory import cpu_has_native_bf16
from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.model.test_parity import experts_packed
from tests.model_families import build_qwen3_moe

MAX_TOKENS = 12
TIE_MARGIN = 0.1  # logits apart, ~3 bf16 steps at these magnitudes (seen: 0, 0.031, 0.062)


def hf_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced: transformers' logits for each output position, float32 [len, vocab]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    return build_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3_moe"])
def test_bf16_greedy_follows_transformers(request, model_name, backend):
    path = request.getfixturevalue(model_name)
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    llm = make_llm(path, dtype="bfloat16", attention_backend=backend)
    assert llm.executor.dtype == torch.bfloat16
    moe = model_name == "tiny_qwen3_moe"  # its experts packed on the cpu backend
    assert experts_packed(llm) == ({backend == "cpu" and cpu_has_native_bf16()} if moe else set())
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
