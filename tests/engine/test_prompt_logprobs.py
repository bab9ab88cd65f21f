"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against transformers' log-softmax
on the same fp32 weights: one prefill, several chunks, a warm prefix cache (bypassed), a
soft-capped model, n > 1, a recompute preemption; every test ends with the blocks free."""

import pytest
import torch
from kvpager.engine.frontend.migration import continuation
from kvpager.engine.request import Request
from kvpager.engine.sched.prompt_logprobs import check_chunk
from kvpager.schemas.errors import InvalidRequestError, InvalidStepError
from kvpager.schemas.sampling import SamplingParams
from kvpager.schemas.scheduler import PromptLogprobs
from transformers import AutoModelForCausalLM

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.model_families import build_gemma2

TOLERANCE = 1e-3


def hf_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """fp32 [len(prompt) - 1, vocab]: row i scores prompt[i + 1]."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def check_against(want: torch.Tensor, prompt: list[int], got, k: int) -> None:
    assert got[0] is None and len(got) == len(prompt)
    for i, (token_id, entry) in enumerate(zip(prompt[1:], got[1:])):
        row = want[i]
        actual = entry[token_id]
        assert abs(actual.logprob - row[token_id].item()) < TOLERANCE, (i, actual, row[token_id])
        assert actual.rank == int((row >= row[token_id]).sum())
        top_values, top_ids = row.topk(k)
        others = {tid: lp for tid, lp in entry.items() if tid != token_id}
        for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            if tid == token_id:
                continue
            assert abs(others[tid].logprob - value) < TOLERANCE and others[tid].rank == rank
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("budget", [2048, 8])  # one prefill; chunks of 8 (5+ chunks)
def test_equal_to_transformers(tiny_llama, budget):
    prompts = random_prompts([41, 9, 2], seed=3)
    llm = make_llm(tiny_llama, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4, logprobs=2)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        check_against(hf_logprobs(tiny_llama, prompt), prompt, output.prompt_logprobs, 4)
        assert len(output.outputs[0].token_ids) == 3
    assert_all_free(llm)


def test_one_token_prompt_and_none_asked(tiny_llama):
    llm = make_llm(tiny_llama)
    one, plain = llm.generate(
        [[5], [5, 6, 7]],
        [SamplingParams(max_tokens=2, prompt_logprobs=0), SamplingParams(max_tokens=2)],
    )
    assert one.prompt_logprobs == [None]
    assert plain.prompt_logprobs is None
    assert_all_free(llm)


def test_prefix_cache_is_bypassed(tiny_llama):
    prompt = random_prompts([40], seed=5)[0]
    llm = make_llm(tiny_llama)
    warm = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens == 32  # four full blocks of 8 come from the cache
    asked = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert asked[0].num_cached_tokens == 0  # every position computed
    assert asked[0].outputs[0].token_ids == warm.outputs[0].token_ids
    check_against(hf_logprobs(tiny_llama, prompt), prompt, asked[0].prompt_logprobs, 1)
    assert_all_free(llm)


def test_parallel_samples_and_recompute_preemption(tiny_llama):
    """n=3 gets the prompt's once; prompts that preempt each other (recompute) still match."""
    prompts = random_prompts([30, 30, 30, 30], seed=7)
    llm = make_llm(tiny_llama, num_blocks=12, preemption_mode="recompute", swap_space=0)
    params = SamplingParams(
        temperature=0.8, seed=1, n=3, max_tokens=20, ignore_eos=True, prompt_logprobs=2
    )
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        assert [len(o.token_ids) for o in output.outputs] == [20, 20, 20]
        check_against(hf_logprobs(tiny_llama, prompt), prompt, output.prompt_logprobs, 2)
    assert_all_free(llm)


def test_soft_capped_logits(tmp_path):
    """Logprobs come from the final (soft-capped) logits, as transformers' Gemma2 has them."""
    path = build_gemma2(tmp_path)
    prompt = random_prompts([13], seed=2)[0]
    llm = make_llm(path)
    got = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    check_against(hf_logprobs(path, prompt), prompt, got.prompt_logprobs, 3)
    assert_all_free(llm)


def test_bounds():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs: must be in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(beam_width=2, temperature=0.0, prompt_logprobs=1)


def test_chunks_are_checked():
    request = Request("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=1))
    good = PromptLogprobs(2, [-0.5, -1.0], [1, 3], [[7], [8]], [[-0.5], [-0.2]])
    check_chunk(good, request, vocab_size=10)
    bad = [
        PromptLogprobs(0, [-0.5], [1], [[7]], [[-0.5]]),  # position 0 has none
        PromptLogprobs(3, [-0.5, -1.0], [1, 1], [[7], [8]], [[-0.5], [-0.2]]),  # past the prompt
        PromptLogprobs(1, [-0.5], [1], [[7, 8]], [[-0.5, -0.6]]),  # two alternatives, k=1
        PromptLogprobs(1, [-0.5], [1], [[10]], [[-0.5]]),  # outside the vocabulary
        PromptLogprobs(1, [0.5], [1], [[7]], [[-0.5]]),  # not a log-probability
        PromptLogprobs(1, [-0.5], [0], [[7]], [[-0.5]]),  # ranks start at 1
        PromptLogprobs(1, [-0.5, -0.1], [1], [[7]], [[-0.5]]),  # ragged
    ]
    for chunk in bad:
        with pytest.raises(InvalidStepError):
            check_chunk(chunk, request, vocab_size=10)


def test_a_moved_stream_asks_again_only_before_its_first_token():
    params = SamplingParams(max_tokens=8, prompt_logprobs=2)
    _, before = continuation([5, 6, 7], [], params)
    _, after = continuation([5, 6, 7], [9], params)
    assert before.prompt_logprobs == 2 and after.prompt_logprobs is None  # came with token 1
