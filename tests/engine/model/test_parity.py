"""Greedy tokens equal transformers' `generate` on the same weights, token for token."""

import random

import pytest
import torch
from kvpager.engine import LLM, SamplingParams
from transformers import AutoModelForCausalLM

BLOCK_SIZE = 8
PROMPT_LENGTHS = [1, 2, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24, 25, 31, 33, 41]
MAX_TOKENS = 20


def make_prompts(seed: int = 0, vocab_size: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 0-2 are special tokens; keep prompts to ordinary text tokens
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(
    path, prompts: list[list[int]], max_tokens: int, model_cls=AutoModelForCausalLM
) -> list[list[int]]:
    """transformers' greedy new tokens, one prompt at a time, by `model_cls` (a multimodal
    checkpoint's ForConditionalGeneration on text alone, say)."""
    model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2"])
def model_and_expected(request):
    path = request.getfixturevalue(request.param)
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def run_engine(path, prompts, **engine_args):
    engine_args.setdefault("attention_backend", "torch")
    if engine_args["attention_backend"] == "cpu":
        engine_args.setdefault("device", "cpu")  # the C kernels read host memory
    llm = LLM(str(path), dtype="float32", block_size=BLOCK_SIZE, **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    llm.check_invariants()
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


def experts_packed(llm: LLM) -> set[bool]:
    """Whether each MoE layer runs its experts on packed matmuls: {} for a dense model."""
    return {
        layer.experts.is_packed for layer in llm.executor.model.layers if layer.experts is not None
    }


def test_one_batch_matches_transformers(model_and_expected):
    path, prompts, expected = model_and_expected
    llm, got = run_engine(path, prompts, num_blocks=128)
    assert got == expected
    assert llm.stats()["peak_running"] == len(prompts)
    assert_all_free(llm)


def test_cpu_backend_matches_transformers(model_and_expected):
    """The C decode kernel (runtime-size path for these head_dim 16 models) in a mixed run."""
    path, prompts, expected = model_and_expected
    llm, got = run_engine(path, prompts, num_blocks=128, attention_backend="cpu")
    assert got == expected
    assert_all_free(llm)


def test_mlp_row_chunks_keep_tokens_exact(model_and_expected, monkeypatch):
    """Long batches run the MLP in row chunks (engine/model/decoder.py); 4-row chunks here."""
    monkeypatch.setattr("kvpager.engine.model.decoder.MLP_CHUNK_TOKENS", 4)
    path, prompts, expected = model_and_expected
    llm, got = run_engine(path, prompts, num_blocks=128)
    assert got == expected
    assert_all_free(llm)


def test_preemption_keeps_tokens_exact(model_and_expected):
    path, prompts, expected = model_and_expected
    # 10 blocks hold one request of 41 + 20 tokens but never all 16 at once
    llm, got = run_engine(path, prompts, num_blocks=10, enable_prefix_caching=False)
    assert llm.stats()["num_preemptions"] > 0
    assert got == expected
    assert_all_free(llm)


def test_chunked_prefill_keeps_tokens_exact(model_and_expected):
    path, prompts, expected = model_and_expected
    llm, got = run_engine(path, prompts, num_blocks=128, max_num_batched_tokens=6, max_num_seqs=4)
    assert llm.stats()["num_steps"] > MAX_TOKENS * 4  # chunks and a 4-request cap
    assert got == expected
    assert_all_free(llm)
