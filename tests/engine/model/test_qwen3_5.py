"""Qwen3.5 text (`qwen3_5_text`, `qwen3_5_moe_text`) and the text part of multimodal `qwen3_5`
/ `qwen3_5_moe` checkpoints greedy-equal to transformers, token for token, in fp32
(tests/qwen3_5_models.py): Qwen3-Next's gated DeltaNet and gated attention with flat DeltaNet
projections, a dense MLP or experts with a gated shared expert on every layer, interleaved
M-RoPE on text positions, tied embeddings. Roomy, under chunked prefill with small chunks and
recompute preemption, n > 1 and beams, and a repeated prompt resumes from a state snapshot;
every block and state slot is free after each run."""

import json

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.kv.recurrent_size import hybrid_size
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import CheckpointError, ConfigError

from tests.engine.helpers import make_llm, random_prompts
from tests.engine.model.test_granite_hybrid import assert_slots_free, greedy
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
    with make_llm(path, num_blocks=256) as llm:
        assert isinstance(llm.scheduler.block_manager, RecurrentBlockManager)
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_slots_free(llm)


def test_chunked_prefill_and_recompute_preemption(qwen3_5):
    path, _, prompts, expected = qwen3_5
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute",
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)


def test_parallel_samples_fork_the_state(qwen3_5):
    """n = 3 forks copy the parent's DeltaNet state: three copies of the greedy output."""
    path, _, prompts, expected = qwen3_5
    with make_llm(path, max_num_batched_tokens=16) as llm:
        params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([prompts[-2]], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [expected[-2]] * 3
        assert_slots_free(llm)


def test_a_repeated_prompt_resumes_from_a_state_snapshot(qwen3_5):
    """A second request with the same 64-token prompt reports at least 32 cached tokens (56:
    7 of its 8 blocks) and the same output, through the DeltaNet layers' state snapshot."""
    path, variant = qwen3_5[:2]
    prompt = random_prompts([64], seed=11)[0]
    expected = hf_greedy_by_class(path, variant, [prompt], MAX_TOKENS)
    with make_llm(path, num_blocks=64, max_num_batched_tokens=20) as llm:
        assert greedy(llm, [prompt]) == expected
        assert llm.stats()["num_state_snapshots"] > 0
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        second = llm.generate([prompt], params, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == expected[0]
        assert second.num_cached_tokens == 56
        assert llm.stats()["state_snapshot_hits"] == 1
        assert_slots_free(llm)


def test_weights_are_what_kv_size_counts(qwen3_5):
    """Every text tensor has its place (flat DeltaNet projections, gated attention, the dense
    MLP or the experts); the vision tower is skipped; the budget counts what the decoder
    holds; `kv-size` sizes the text model's states and K/V."""
    path = qwen3_5[0]
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, path)
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)
    size = hybrid_size(json.loads((path / "config.json").read_text()))
    assert (size.num_recurrent_layers, size.num_attention_layers) == (2, 2)
    # per DeltaNet layer: conv (2 * 2 * 16 + 4 * 16) x 3; state 4 x 16 x 16
    assert (size.conv_elements, size.ssm_elements) == (2 * 128 * 3, 2 * 4 * 16 * 16)
    assert size.kv_elements_per_token == 2 * 2 * 2 * 16


def test_a_multimodal_config_without_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(CheckpointError, match="text_config"):
        ModelConfig.from_path(tmp_path)
