"""The checks every recurrent family passes against transformers (the Mamba2 hybrids, Granite 4
and Nemotron-H, and the gated DeltaNet ones, Qwen3-Next and Qwen3.5, run them on their own tiny
checkpoints): roomy, chunked prefill, recompute
preemption with small chunks, n > 1 and beams (a fork copies its parent's state), a repeated
prompt served from a state snapshot, the weights kv-size counts, bf16 within the tie margin;
every block and state slot free after each run."""

from collections.abc import Callable

import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops

from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts
from tests.engine.model.test_bf16 import MAX_TOKENS as BF16_TOKENS
from tests.engine.model.test_bf16 import assert_follows_transformers
from tests.engine.model.test_parity import MAX_TOKENS, hf_greedy

# prompts -> transformers' greedy new tokens of each
HfGreedy = Callable[[list[list[int]]], list[list[int]]]


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_slots_free(llm) -> None:
    assert_all_free(llm)
    slots = llm.scheduler.block_manager.slots
    assert not slots.owner and slots.num_free == slots.num_slots


def check_roomy(path, prompts, expected) -> None:
    with make_llm(path, num_blocks=256) as llm:
        assert isinstance(llm.scheduler.block_manager, RecurrentBlockManager)
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_slots_free(llm)


def check_chunked(path, prompts, expected, chunk: int) -> None:
    with make_llm(path, max_num_batched_tokens=chunk, max_num_seqs=4) as llm:
        assert greedy(llm, prompts) == expected
        assert_slots_free(llm)


def check_recompute(
    path, prompts, expected, num_blocks: int, chunk: int, seqs: int, prefix_caching: bool = False
) -> None:
    """Recompute preemption with small chunks: prefix caching off (the state restarts), or on
    (a recomputed sequence may resume from its own snapshot)."""
    with make_llm(
        path, num_blocks=num_blocks, max_num_batched_tokens=chunk, max_num_seqs=seqs,
        preemption_mode="recompute", enable_prefix_caching=prefix_caching,
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)


def check_parallel_samples(path, prompt, expected) -> None:
    """n = 3 greedy samples fork as the prompt completes: each child's state is its parent's."""
    with make_llm(path, max_num_batched_tokens=16) as llm:
        params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [expected] * 3
        assert_slots_free(llm)


def check_beams(path, width: int) -> None:
    """Beams chosen twice fork before the pass: the state is copied, then advanced."""
    prompts = random_prompts([1, 6, 17], seed=5)
    with make_llm(path) as llm:
        params = SamplingParams(beam_width=width, temperature=0.0, max_tokens=8)
        got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)]
        expected = hf_generate(path, prompts, max_new_tokens=8, num_beams=width, do_sample=False)
        assert got == expected
        assert_slots_free(llm)


def check_repeated_prompt(path, reference: HfGreedy | None = None, **engine) -> None:
    """Done criterion of issue 46: a second request with the same 64-token prompt reports at
    least 32 cached tokens (here 56: 7 of its 8 blocks, the last token is always computed)
    and the same output; the snapshot hit and bytes are counted apart from blocks.
    `reference` gives transformers' greedy tokens (default: AutoModelForCausalLM's)."""
    prompt = random_prompts([64], seed=11)[0]
    expected = (reference or (lambda ps: hf_greedy(path, ps, MAX_TOKENS)))([prompt])
    with make_llm(path, num_blocks=64, **engine) as llm:
        assert greedy(llm, [prompt]) == expected
        first = llm.stats()
        assert first["num_state_snapshots"] > 0 and first["state_snapshot_bytes"] > 0
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        second = llm.generate([prompt], params, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == expected[0]
        assert second.num_cached_tokens == 56  # the request reports it too
        stats = llm.stats()
        hit_tokens = stats["prefix_cache_hit_tokens"] - first["prefix_cache_hit_tokens"]
        assert hit_tokens >= 32 and hit_tokens == 56, stats
        assert stats["state_snapshot_hits"] == 1 and stats["state_snapshot_hit_tokens"] == 56
        assert_slots_free(llm)


def check_weights_counted(path) -> None:
    """Every checkpoint tensor has its place, and the memory budget counts what the decoder
    holds."""
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, path)
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)


def check_bf16(path) -> None:
    """Each greedy token within test_bf16.py's tie margin of transformers' bf16 best, up to
    the first near tie."""
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    with make_llm(path, dtype="bfloat16") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_follows_transformers(path, prompts, outputs)
        assert_slots_free(llm)
