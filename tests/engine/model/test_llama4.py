"""Llama 4 text greedy-equal to transformers' `generate`, token for token: chunked local
attention (16-token chunks, two blocks of 8) on layers 0, 2, 3 and a NoPE full-attention layer
1, interleaved MoE with a shared expert (tests/model_families.py: build_llama4). Roomy, on the
CPU backend's C kernels, under recompute and swap preemption, under chunked prefill, on
prefix hits and in the Triton kernels (interpreted); the chunked groups free the blocks of
finished chunks, so a long sequence holds two blocks in each; every run ends all free."""

import json

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.hybrid_manager import HybridBlockManager
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import ConfigError
from transformers import Llama4ForConditionalGeneration, Llama4TextConfig

from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts
from tests.engine.model.test_bf16 import MAX_TOKENS as BF16_TOKENS
from tests.engine.model.test_bf16 import assert_follows_transformers
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy, make_prompts
from tests.model_families import CHUNK, build_llama4, build_llama4_multimodal


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    path = build_llama4(tmp_path_factory.mktemp("llama4"))
    prompts = make_prompts()  # 1-41 tokens, then 20 more: up to four chunks
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_config_reads_as_transformers_does(llama4):
    """Chunked layers are the RoPE ones, MoE every second layer, dense layers
    intermediate_size_mlp wide; four KV groups: one full, three chunked."""
    config = ModelConfig.from_path(llama4[0])
    assert config.layer_windows == (-CHUNK, 0, -CHUNK, -CHUNK)
    assert config.nope_layers == (False, True, False, False)
    assert config.sparse_layers == (False, True, False, True)
    assert (config.intermediate_size, config.moe_intermediate_size) == (96, 32)
    assert config.attn_temperature == (4.0, 0.5) and config.qk_l2_norm
    with make_llm(llama4[0]) as llm:
        manager = llm.scheduler.block_manager
        assert isinstance(manager, HybridBlockManager)
        assert [g.window for g in manager.groups] == [0, -CHUNK, -CHUNK, -CHUNK]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_roomy_matches_transformers(llama4, backend):
    path, prompts, expected = llama4
    with make_llm(path, num_blocks=512, attention_backend=backend) as llm:
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_small_prefill_chunks_keeps_tokens_exact(llama4, mode):
    path, prompts, expected = llama4
    with make_llm(
        path, num_blocks=24, max_num_batched_tokens=6, max_num_seqs=4, preemption_mode=mode,
        swap_space=1 << 20, enable_prefix_caching=False, attention_backend="cpu",
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0, stats
        if mode == "swap":
            assert stats["num_swap_preemptions"] > 0 and stats["num_swapped_in_blocks"] > 0
        assert_all_free(llm)


def test_chunked_prefill_keeps_tokens_exact(llama4):
    path, prompts, expected = llama4
    with make_llm(path, max_num_batched_tokens=6, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)


@pytest.fixture(scope="module")
def long_sequence(llama4):
    prompt = random_prompts([40], seed=5)[0]
    return prompt, hf_generate(llama4[0], [prompt], max_new_tokens=200, do_sample=False)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_finished_chunks_free_their_blocks(llama4, long_sequence, backend):
    """A 40-token prompt and 200 new tokens (15 chunks): the full group holds all 30 blocks,
    each chunked group at most its chunk's two, so 36 blocks serve what full attention on
    every layer would hold in 120; exact, no preemption."""
    path, (prompt, expected) = llama4[0], long_sequence
    with make_llm(path, num_blocks=40, max_num_batched_tokens=8, attention_backend=backend) as llm:
        assert greedy(llm, [prompt], 200) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] == 0 and stats["peak_used_blocks"] == 30 + 3 * 2, stats
        assert_all_free(llm)


def test_prefix_hits_on_chunked_groups(llama4):
    """The second run of prompts of 26, 33 and 41 tokens hits every full block of each: the
    full group on every block, the chunked groups on the blocks of the prefix end's chunk."""
    path, prompts, expected = llama4
    with make_llm(path, num_blocks=256) as llm:
        assert greedy(llm, prompts) == expected
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        assert greedy(llm, prompts[-3:]) == expected[-3:]
        assert llm.stats()["prefix_cache_hit_tokens"] - hits_before == (3 + 4 + 5) * 8
        assert_all_free(llm)


def test_triton_backend(llama4):
    """Paged attention's chunk mask and the grouped MoE kernel, interpreted on the CPU."""
    path, prompts, _ = llama4
    chosen = prompts[-3:]  # 25-41 tokens: past the first chunk
    with make_llm(path, attention_backend="triton", max_num_batched_tokens=16) as llm:
        assert greedy(llm, chosen, 6) == hf_greedy(path, chosen, 6)
        assert_all_free(llm)


def test_a_chunk_the_block_size_does_not_divide_is_refused(llama4):
    with pytest.raises(ConfigError, match="chunk size 16 is not a multiple of block_size 32"):
        make_llm(llama4[0], block_size=32)
    with pytest.raises(ConfigError, match="llama4_text is served on one rank"):
        ModelConfig.from_path(llama4[0]).check_tensor_parallel(2)


def test_weights_are_what_kv_size_counts(llama4):
    config = ModelConfig.from_path(llama4[0])
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, llama4[0])
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)


def test_defaults_and_the_multimodal_config_parse_as_transformers_reads_them(tmp_path, capsys):
    """No no_rope_layers, moe_layers or layer_types: transformers derives them (every 4th layer
    NoPE and full, MoE every 2nd); a `llama4` config's text_config is the model. kv-size: the
    36 chunked layers of 48 hold 512 blocks of 16 each at most, beside the 12 full ones."""
    from kvpager.services.cli import main

    text = dict(vocab_size=1024, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                interleave_moe_layer_step=2, torch_dtype="bfloat16")  # fmt: skip
    want = Llama4TextConfig(**text)
    raw = {"model_type": "llama4", "text_config": {**text, "model_type": "llama4_text"},
           "vision_config": {"hidden_size": 8}}  # fmt: skip
    config = ModelConfig.from_dict(raw)
    chunk = want.attention_chunk_size
    assert config.layer_windows == tuple(
        -chunk if kind == "chunked_attention" else 0 for kind in want.layer_types
    )
    assert config.nope_layers == tuple(not flag for flag in want.no_rope_layers)
    assert config.sparse_layers == tuple(i in want.moe_layers for i in range(48))
    assert config.attn_temperature == (want.floor_scale, want.attn_scale)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["kv-size", str(tmp_path), "--tokens", "65536", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    per_layer_block = 16 * 2 * 2 * 16 * 2  # tokens, K and V, KV heads, head_dim, bf16
    held = (12 * 4096 + 36 * 512) * per_layer_block
    assert f"paged, windows freeing:  {held:,}" in out and "chunked layers their chunk's" in out


@pytest.fixture(scope="module")
def llama4_variant(tmp_path_factory):
    """Unlike build_llama4's: 5 layers, NoPE every 3rd (derived), 8-token chunks (one block),
    every layer MoE with top 2 of 6 experts, no q/k norm, GQA 4:1, llama3 RoPE scaling."""
    rope = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
    path = build_llama4(
        tmp_path_factory.mktemp("llama4-variant"), seed=19, num_hidden_layers=5,
        no_rope_layers=None, no_rope_layer_interval=3, attention_chunk_size=8,
        interleave_moe_layer_step=1, num_local_experts=6, num_experts_per_tok=2,
        use_qk_norm=False, num_attention_heads=8, num_key_value_heads=2, floor_scale=3,
        rope_parameters=rope,
    )  # fmt: skip
    prompts = random_prompts([4, 13, 22, 35], seed=7)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def test_a_second_config_matches_transformers(llama4_variant):
    path, prompts, expected = llama4_variant
    config = ModelConfig.from_path(path)
    assert config.layer_windows == (-8, -8, 0, -8, -8) and all(config.sparse_layers)
    with make_llm(path, attention_backend="cpu") as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=5, enable_prefix_caching=False
    ) as llm:
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


def test_samples_and_beams_fork_chunked_tables(llama4):
    """n = 3 greedy samples fork every group's table (copy-on-write of the shared tail); a
    beam search of width 3 forks and frees beams' tables, all equal to transformers."""
    path = llama4[0]
    prompt = random_prompts([21], seed=3)[0]
    with make_llm(path, num_blocks=256) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=20))[0]
        expected = hf_generate(path, [prompt], max_new_tokens=20, do_sample=False)
        assert [c.token_ids for c in out.outputs] == expected * 3
        assert llm.stats()["num_block_copies"] > 0
        prompts = random_prompts([6, 17], seed=5)
        params = SamplingParams(beam_width=3, temperature=0.0, max_tokens=12)
        got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)]
        beams = hf_generate(path, prompts, max_new_tokens=12, num_beams=3, do_sample=False)
        assert got == beams
        assert_all_free(llm)


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A `llama4` checkpoint: its text_config is the model, its `language_model.` weights are
    read and the vision tower's left; text prompts equal Llama4ForConditionalGeneration's."""
    path = build_llama4_multimodal(tmp_path)
    prompts = random_prompts([5, 23, 37], seed=2)
    model = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                             do_sample=False)  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    with make_llm(path, attention_backend="cpu") as llm:
        assert greedy(llm, prompts) == expected
        assert_all_free(llm)


@pytest.fixture(scope="module")
def llama4_one_expert(tmp_path_factory):
    """build_llama4 with one routed expert: in bf16 the tiny random router's top-1 logits sit
    a bf16 step apart (seen: 0.03), so a rounding flips a token's expert and its logits move
    by whole units, a tie the final-logit margin cannot see; one expert cannot flip."""
    return build_llama4(tmp_path_factory.mktemp("llama4-one-expert"), num_local_experts=1)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_greedy_follows_transformers(llama4_one_expert, backend):
    """bf16 (the cpu backend: its experts packed where the CPU has native bf16, the chunked
    mask on the tile kernel where it has AMX or AVX512-BF16): each greedy token within
    test_bf16.py's tie margin of transformers' bf16 best, up to the first near tie."""
    path = llama4_one_expert
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    with make_llm(path, dtype="bfloat16", attention_backend=backend) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_follows_transformers(path, prompts, outputs)
        assert_all_free(llm)
