"""The real default model: engine greedy text equals transformers on the converted checkpoint."""

import pytest
import torch
from kvpager.engine import SamplingParams
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import assert_all_free, make_llm

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about memory pages."}],
]
PROMPTS = ["The three primary colors are", "def fibonacci(n):"]
MAX_TOKENS = 16


def test_greedy_text_equals_transformers(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [
        tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for chat in CHATS
    ] + [tokenizer.encode(p) for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    expected = []
    for ids in prompts:
        ids_tensor = torch.tensor([ids])
        out = model.generate(
            ids_tensor,
            attention_mask=torch.ones_like(ids_tensor),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
        expected.append(out[0, len(ids) :].tolist())
    # the CPU backend: oneDNN-packed matmuls and the C decode kernel's literal-size path
    llm = make_llm(smollm2_path, block_size=16, num_blocks=64, attention_backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat_outs = llm.chat(CHATS, params)
    text_outs = llm.generate(PROMPTS, params)
    got = [o.outputs[0].token_ids for o in chat_outs + text_outs]
    assert got == expected
    assert "Paris" in chat_outs[0].outputs[0].text
    for out, exp in zip(chat_outs + text_outs, expected):
        assert out.outputs[0].text == tokenizer.decode(
            exp[: len(out.outputs[0].token_ids)], skip_special_tokens=True
        )
    assert_all_free(llm)
