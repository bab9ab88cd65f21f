"""Qwen3-Next (`qwen3_next`) greedy-equal to transformers' `generate`, token for token, in fp32
(tests/model_families.py: build_qwen3_next): gated DeltaNet layers on state slots beside gated
attention layers (partial RoPE, output gate) on the paged cache, MoE with a gated shared
expert beside a dense layer, (1 + w) norms. Roomy, under chunked prefill with small chunks
and recompute preemption, n > 1 and beams, and a repeated prompt resumes from a state
snapshot; every block and state slot is free after each run."""

import pytest
from kvpager.engine.model_config import ModelConfig

from tests.engine.helpers import make_llm
from tests.engine.model import hybrid_checks as checks
from tests.engine.model.hybrid_checks import assert_slots_free, greedy
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import build_qwen3_next


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = build_qwen3_next(tmp_path_factory.mktemp("qwen3_next"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(qwen3_next):
    config = ModelConfig.from_path(qwen3_next[0])
    assert config.recurrent_layers == (True, False, True, False)
    assert config.recurrent_mixer == "gated_deltanet" and config.num_kv_layers == 2
    assert config.sparse_layers == (True, False, True, True)
    assert config.partial_rotary_factor == 0.25 and config.attn_output_gate
    assert config.zero_centred_norms and config.shared_expert_gate


def test_roomy_matches_transformers(qwen3_next):
    checks.check_roomy(*qwen3_next)


def test_chunked_prefill_and_recompute_preemption(qwen3_next):
    path, prompts, expected = qwen3_next
    with make_llm(path, max_num_batched_tokens=6, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == expected
        assert_slots_free(llm)
    checks.check_recompute(path, prompts, expected, 16, chunk=6, seqs=4, prefix_caching=True)


def test_parallel_samples_and_beams(qwen3_next):
    """n = 3 forks copy the parent's state; beams chosen twice fork before the pass."""
    path, prompts, expected = qwen3_next
    checks.check_parallel_samples(path, prompts[-2], expected[-2])
    checks.check_beams(path, 2)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(qwen3_next):
    checks.check_repeated_prompt(qwen3_next[0], max_num_batched_tokens=20)


def test_weights_are_what_kv_size_counts(qwen3_next):
    """DeltaNet mixers, gated attention, per-expert MoE tensors, the dense layer."""
    checks.check_weights_counted(qwen3_next[0])


def test_bf16_greedy_follows_transformers(tmp_path):
    """bf16 ((1 + w) norms in fp32, rounded once; the delta rule's state in fp32, as
    transformers' layers): each greedy token within test_bf16.py's tie margin of
    transformers' bf16 best, up to the first near tie. Smaller weights than the fp32 tests':
    with theirs transformers' own bf16 forward strays up to 3.9 from its fp32 one."""
    checks.check_bf16(build_qwen3_next(tmp_path, initializer_range=0.05))
