"""Granite 4 hybrids (`granitemoehybrid`) greedy-equal to transformers' `generate`, token for
token, in fp32 (tests/model_families.py: build_granite_hybrid): Mamba2 layers on state slots
beside an attention layer on the paged cache, MoE beside a shared MLP, every multiplier. Roomy,
under chunked prefill (a chunk resumes from the state the last one left), under recompute
preemption with small chunks, with n > 1 and beams (a fork copies its parent's state); every
block and state slot is free after each run."""

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.model_config import ModelConfig

from tests.engine.helpers import assert_all_free, make_llm
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_granite_hybrid


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_slots_free(llm) -> None:
    assert_all_free(llm)
    slots = llm.scheduler.block_manager.slots
    assert not slots.owner and slots.num_free == slots.num_slots


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = build_granite_hybrid(tmp_path_factory.mktemp("granite"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(granite):
    config = ModelConfig.from_path(granite[0])
    assert config.recurrent_layers == (True, False, True)
    assert config.num_kv_layers == 1 and config.attention_scale == 0.2
    assert config.sparse_layers == (True,) * 3 and config.shared_expert_intermediate_size == 48
    assert (config.embedding_multiplier, config.residual_multiplier) == (2.0, 0.5)
    assert config.mamba_dims.time_step_limit == (0.0, float("inf"))


def test_roomy_matches_transformers(granite):
    path, prompts, expected = granite
    with make_llm(path, num_blocks=256) as llm:
        assert isinstance(llm.scheduler.block_manager, RecurrentBlockManager)
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_slots_free(llm)


def test_chunked_prefill_resumes_from_the_state(granite):
    path, prompts, expected = granite
    with make_llm(path, max_num_batched_tokens=6, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == expected
        assert_slots_free(llm)


def test_recompute_preemption_with_small_chunks(granite):
    path, prompts, expected = granite
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute", enable_prefix_caching=False,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)
