"""The end-to-end checks every gated DeltaNet family runs (tests/engine/model/test_qwen3_next.py,
test_qwen3_5.py): greedy-equal to transformers roomy, under chunked prefill and recompute
preemption, with n = 3 forks and beams, and from a state snapshot; every block and state slot
free after each run; the loader fills what the memory budget counts."""

from collections.abc import Callable

import torch
from kvpager.engine import SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.kv.state_slots import RecurrentBlockManager
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels.backend import get_kernel_ops

from tests.engine.helpers import hf_generate, make_llm, random_prompts
from tests.engine.model.test_granite_hybrid import assert_slots_free, greedy
from tests.engine.model.test_parity import MAX_TOKENS

# prompts -> transformers' greedy new tokens of each
HfGreedy = Callable[[list[list[int]]], list[list[int]]]


def check_roomy(path, prompts, expected) -> None:
    with make_llm(path, num_blocks=256) as llm:
        assert isinstance(llm.scheduler.block_manager, RecurrentBlockManager)
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] == 0
        assert_slots_free(llm)


def check_recompute_preemption(path, prompts, expected) -> None:
    """6-token prefill chunks in a 16-block cache: sequences are preempted and recomputed."""
    with make_llm(
        path, num_blocks=16, max_num_batched_tokens=6, max_num_seqs=4,
        preemption_mode="recompute",
    ) as llm:  # fmt: skip
        assert greedy(llm, prompts) == expected
        assert llm.stats()["num_preemptions"] > 0, llm.stats()
        assert_slots_free(llm)


def check_parallel_samples(path, prompt: list[int], expected: list[int]) -> None:
    """n = 3 forks copy the parent's state: three copies of the greedy output."""
    with make_llm(path, max_num_batched_tokens=16) as llm:
        params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [expected] * 3
        assert_slots_free(llm)


def check_beams(path) -> None:
    """Beams of 2 (a beam chosen twice forks its state before the pass) equal transformers'
    beam search (AutoModelForCausalLM's class for the checkpoint)."""
    prompts = random_prompts([1, 6, 17], seed=5)
    with make_llm(path) as llm:
        params = SamplingParams(beam_width=2, temperature=0.0, max_tokens=8)
        beams = llm.beam_search(prompts, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in beams]
        assert got == hf_generate(path, prompts, max_new_tokens=8, num_beams=2, do_sample=False)
        assert_slots_free(llm)


def check_snapshot_resume(path, hf_greedy: HfGreedy) -> None:
    """A second request with the same 64-token prompt reports at least 32 cached tokens (56:
    7 of its 8 blocks) and the same output, through the DeltaNet layers' state snapshot."""
    prompt = random_prompts([64], seed=11)[0]
    expected = hf_greedy([prompt])
    with make_llm(path, num_blocks=64, max_num_batched_tokens=20) as llm:
        assert greedy(llm, [prompt]) == expected
        assert llm.stats()["num_state_snapshots"] > 0
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        second = llm.generate([prompt], params, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == expected[0]
        assert second.num_cached_tokens == 56
        assert llm.stats()["state_snapshot_hits"] == 1
        assert_slots_free(llm)


def check_weights_counted(path) -> None:
    """Every checkpoint tensor has its place, and the memory budget counts what the decoder
    holds."""
    config = ModelConfig.from_path(path)
    decoder = Decoder(config, torch.float32, 64, get_kernel_ops("torch"))
    read = load_weights(decoder, path)
    held = sum(p.numel() * p.element_size() for p in decoder.parameters())
    assert read == held == weight_bytes_per_rank(config, torch.float32)
