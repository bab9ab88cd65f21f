"""The engine with the real Triton kernels (interpreted on CPU) keeps greedy parity."""

from kvpager.engine import SamplingParams

from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts


def test_triton_backend_matches_transformers(tiny_qwen2):
    # lengths around the block size: one token, exactly one block, several blocks
    prompts = random_prompts([1, 8, 13, 19], seed=11)
    expected = hf_generate(tiny_qwen2, prompts, max_new_tokens=6, do_sample=False)
    llm = make_llm(tiny_qwen2, attention_backend="triton", max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_steps"] > 6  # the 16-token budget chunks the prefills
    assert_all_free(llm)


def test_triton_backend_copy_on_write_and_swap(tiny_qwen2):
    prompts = random_prompts([5, 11], seed=12)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    reference = make_llm(tiny_qwen2).generate(prompts, params)
    llm = make_llm(
        tiny_qwen2,
        attention_backend="triton",
        num_blocks=4,
        swap_space=1 << 20,
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, params)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    assert got == [[c.token_ids for c in o.outputs] for o in reference]
    stats = llm.stats()
    assert stats["num_block_copies"] > 0 and stats["num_swap_preemptions"] > 0
    assert_all_free(llm)
