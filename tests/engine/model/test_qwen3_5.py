"""Qwen3.5 text (`qwen3_5_text`, `qwen3_5_moe_text`) and the text part of multimodal `qwen3_5`
/ `qwen3_5_moe` checkpoints greedy-equal to transformers, token for token, in fp32
(tests/qwen3_5_models.py): Qwen3-Next's gated DeltaNet and gated attention with flat DeltaNet
projections, a dense MLP or experts with a gated shared expert on every layer, interleaved
M-RoPE on text positions, tied embeddings. Roomy, under chunked prefill with small chunks and
recompute preemption, n = 3 forks and beams, and a repeated prompt resumes from a state
snapshot; every block and state slot is free after each run
(tests/engine/model/hybrid_checks.py)."""

import json

import pytest
from kvpager.engine.kv.recurrent_size import hybrid_size
from kvpager.engine.model_config import ModelConfig
from kvpager.schemas.errors import CheckpointError, ConfigError

from tests.engine.model import hybrid_checks as checks
from tests.engine.model.test_parity import MAX_TOKENS, make_prompts
from tests.qwen3_5_models import VARIANTS, build_qwen3_5, hf_greedy_by_class

# multimodal qwen3_5 ties its embeddings (as the small Qwen3.5 checkpoints do)
TIED = {"qwen3_5": True}


@pytest.fixture(scope="module", params=list(VARIANTS))
def qwen3_5(request, tmp_path_factory):
    variant = request.param
    path = build_qwen3_5(tmp_path_factory.mktemp(variant), variant, tied=TIED.get(variant, False))
    prompts = make_prompts()
    return path, variant, prompts, hf_greedy_by_class(path, variant, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(qwen3_5):
    path, variant = qwen3_5[:2]
    config = ModelConfig.from_path(path)
    moe = "moe" in variant
    assert config.model_type == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert config.recurrent_layers == (True, False, True, False)
    assert config.recurrent_mixer == "gated_deltanet" and config.num_kv_layers == 2
    assert config.sparse_layers == (moe,) * 4 and config.shared_expert_gate == moe
    assert config.norm_topk_prob == moe
    assert config.partial_rotary_factor == 0.25 and config.rope_scaling is None
    assert config.attn_output_gate and config.zero_centred_norms and config.qk_norm
    assert config.tie_word_embeddings == TIED.get(variant, False)
    with pytest.raises(ConfigError, match="one rank"):
        config.check_tensor_parallel(2)


def test_roomy_matches_transformers(qwen3_5):
    path, _, prompts, expected = qwen3_5
    checks.check_roomy(path, prompts, expected)


def test_chunked_prefill_and_recompute_preemption(qwen3_5):
    path, _, prompts, expected = qwen3_5
    checks.check_recompute(path, prompts, expected, 16, chunk=6, seqs=4, prefix_caching=True)


def test_parallel_samples_and_beams_fork_the_state(qwen3_5):
    """n = 3; beams on the text checkpoints (AutoModelForCausalLM's beam search is the
    reference: it reads a text config)."""
    path, variant, prompts, expected = qwen3_5
    checks.check_parallel_samples(path, prompts[-2], expected[-2])
    if variant.endswith("_text"):
        checks.check_beams(path, 2)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(qwen3_5):
    path, variant = qwen3_5[:2]
    reference = lambda ps: hf_greedy_by_class(path, variant, ps, MAX_TOKENS)  # noqa: E731
    checks.check_repeated_prompt(path, reference, max_num_batched_tokens=20)


def test_weights_are_what_kv_size_counts(qwen3_5):
    """Every text tensor has its place (flat DeltaNet projections, gated attention, the dense
    MLP or the experts), the vision tower is skipped, and `kv-size` sizes the text model's
    states and K/V."""
    path = qwen3_5[0]
    checks.check_weights_counted(path)
    size = hybrid_size(json.loads((path / "config.json").read_text()))
    assert (size.num_recurrent_layers, size.num_attention_layers) == (2, 2)
    # per DeltaNet layer: conv (2 * 2 * 16 + 4 * 16) x 3; state 4 x 16 x 16
    assert (size.conv_elements, size.ssm_elements) == (2 * 128 * 3, 2 * 4 * 16 * 16)
    assert size.kv_elements_per_token == 2 * 2 * 2 * 16


def test_a_multimodal_config_without_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(CheckpointError, match="text_config"):
        ModelConfig.from_path(tmp_path)
