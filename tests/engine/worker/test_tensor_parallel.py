"""Tensor parallelism on CPU: two gloo ranks of one thread each, greedy tokens equal to
transformers' in every set-up the scheduler produces, each rank reading only its shard, a hung
rank failing the executor in bounded time, and bad sizes refused with typed errors.

Each LLM here starts a second process (rank 1); one LLM covers several set-ups to keep it fast.
"""

import signal
import time

import psutil
import pytest
import torch
from kvpager.engine import LLM, SamplingParams
from kvpager.engine.kv.kv_size import weight_bytes_per_rank
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model.sharding import Shard
from kvpager.engine.model_config import ModelConfig
from kvpager.engine.parallel.spawn import check_devices
from kvpager.kernels.backend import get_kernel_ops
from kvpager.schemas.errors import ConfigError, ExecutorUnavailableError

from tests.engine.helpers import assert_all_free, hf_generate, random_prompts
from tests.engine.kv.test_kv_size import LLAMA_31_70B
from tests.engine.model.test_bf16 import MAX_TOKENS as BF16_TOKENS
from tests.engine.model.test_bf16 import assert_follows_transformers
from tests.engine.test_prompt_logprobs import check_against, hf_logprobs
from tests.model_families import (
    build_gemma2,
    build_gemma3,
    build_gpt_oss,
    build_phi3,
    build_qwen3_moe,
)
from tests.models import build_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPTS = random_prompts([1, 5, 9, 12, 17, 23, 31, 41], seed=7)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """Rank 0 (this process) and rank 1 split this process's threads: 2 -> 1 each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def odd_vocab_llama(tmp_path_factory):
    """385 rows: rank 1 holds 192 real ones and a row of padding."""
    return build_llama(tmp_path_factory.mktemp("llama-385"), vocab_size=385)


def tp_llm(path, **overrides) -> LLM:
    args = dict(dtype="float32", block_size=8, num_blocks=128, attention_backend="torch")
    return LLM(str(path), tensor_parallel_size=2, **{**args, **overrides})


def greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy(path, prompts, max_tokens: int = 16) -> list[list[int]]:
    return hf_generate(path, prompts, max_new_tokens=max_tokens, do_sample=False)


def check_beams_and_samples(llm: LLM, path) -> None:
    """n = 4 greedy samples (forks, copy-on-write of the shared tail) and beam search."""
    prompt = random_prompts([13], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0.0, max_tokens=8))[0]
    assert [c.token_ids for c in out.outputs] == hf_greedy(path, [prompt], 8) * 4
    assert llm.stats()["num_block_copies"] > 0
    prompts = random_prompts([6, 17], seed=5)
    params = SamplingParams(beam_width=3, temperature=0.0, max_tokens=8)
    got = [o.outputs[0].token_ids for o in llm.beam_search(prompts, params, use_tqdm=False)]
    assert got == hf_generate(path, prompts, max_new_tokens=8, num_beams=3, do_sample=False)


def test_llama_kv_heads_split_roomy_swapped_prefix_hits_samples_beams(tiny_llama):
    """2 KV heads, one a rank; a 10-block cache: roomy for one prompt, swap preemption and
    CPU-tier evictions for eight, prefix hits after."""
    with tp_llm(tiny_llama, num_blocks=10, swap_space=1 << 20, preemption_mode="swap") as llm:
        assert llm.executor.ready("x", "m").world_size == 2
        assert llm.executor.kv_cache.shape[4] == 1  # this rank's KV head
        assert greedy(llm, PROMPTS[3:4]) == hf_greedy(tiny_llama, PROMPTS[3:4])
        assert llm.stats()["num_preemptions"] == 0
        expected = hf_greedy(tiny_llama, PROMPTS)
        assert greedy(llm, PROMPTS) == expected
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0, stats
        # swap-outs of preempted rows and of evicted prefix blocks (the CPU tier); swap-ins
        assert stats["num_swapped_out_blocks"] > stats["num_swapped_in_blocks"] > 0, stats
        assert greedy(llm, PROMPTS[-2:]) == expected[-2:]  # 31 and 41 tokens: full blocks hit
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        check_beams_and_samples(llm, tiny_llama)
        assert_all_free(llm)


def test_qwen2_kv_head_replicated_under_recompute(tiny_qwen2):
    """1 KV head for 2 ranks: both hold it; tied embeddings split by vocab rows; q/k/v bias."""
    with tp_llm(tiny_qwen2, num_blocks=10, preemption_mode="recompute") as llm:
        assert llm.executor.kv_cache.shape[4] == 1 and llm.executor.shard.num_heads == 2
        assert greedy(llm, PROMPTS[:1]) == hf_greedy(tiny_qwen2, PROMPTS[:1])
        assert greedy(llm, PROMPTS) == hf_greedy(tiny_qwen2, PROMPTS)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_swap_preemptions"] == 0, stats
        check_beams_and_samples(llm, tiny_qwen2)
        assert_all_free(llm)


def test_vocab_not_divisible_by_the_ranks(odd_vocab_llama):
    """Also prompt logprobs, in chunks: the padding row stays out of their log-softmax."""
    with tp_llm(odd_vocab_llama, max_num_batched_tokens=16) as llm:
        assert llm.executor.model.embed_tokens.shape[0] == 193
        assert greedy(llm, PROMPTS) == hf_greedy(odd_vocab_llama, PROMPTS)
        prompt = PROMPTS[-1]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
        got = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
        check_against(hf_logprobs(odd_vocab_llama, prompt), prompt, got, 2)
        assert_all_free(llm)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_each_rank_reads_and_holds_only_its_shard(request, model):
    path = request.getfixturevalue(model)
    config = ModelConfig.from_path(path)
    ops = get_kernel_ops("torch")

    def load(rank: int, size: int) -> tuple[int, int]:
        decoder = Decoder(config, torch.float32, 64, ops, Shard.of(config, rank, size))
        read = load_weights(decoder, path)
        held = sum(p.numel() * p.element_size() for p in decoder.parameters())
        return read, held

    whole, _ = load(0, 1)
    assert whole == weight_bytes_per_rank(config, torch.float32, 1)
    # replicated on both ranks: the norms, and for Qwen2 its single K/V head and their bias
    kv = 2 * config.head_dim * (config.hidden_size + int(config.attention_bias))
    replicated = 4 * (config.num_layers * 2 * config.hidden_size + config.hidden_size)
    replicated += 4 * config.num_layers * kv * (config.num_kv_heads < 2)
    for rank in (0, 1):
        read, held = load(rank, 2)
        assert read == held == weight_bytes_per_rank(config, torch.float32, 2)
        assert read == (whole - replicated) // 2 + replicated


def test_a_hung_rank_fails_the_executor_within_its_timeout(tiny_llama):
    llm = tp_llm(tiny_llama, tensor_parallel_timeout=2.0)
    (rank1,) = llm.executor.ranks.processes
    assert greedy(llm, PROMPTS[:2]) == hf_greedy(tiny_llama, PROMPTS[:2])
    psutil.Process(rank1.pid).send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(ExecutorUnavailableError, match="tensor-parallel rank was lost"):
            greedy(llm, PROMPTS)
        assert time.monotonic() - started < 2.0 + 3.0
        with pytest.raises(ExecutorUnavailableError):  # lost for good, and says so at once
            llm.executor.execute(llm.scheduler.schedule())
    finally:
        psutil.Process(rank1.pid).send_signal(signal.SIGCONT)
    llm.close()
    assert rank1.poll() is not None  # it left the group on its own timeout (or was reaped)


def test_bad_sizes_are_typed_errors(tiny_llama):
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        LLM(str(tiny_llama), tensor_parallel_size=0)
    message = "tensor_parallel_size: 3 does not divide num_attention_heads 4, num_key_value"
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    Shard.of(ModelConfig.from_path(tiny_llama), 3, 4)  # 2 KV heads, each on 2 of 4 ranks
    odd = ModelConfig.from_dict(
        {**LLAMA_31_70B, "num_attention_heads": 12, "num_key_value_heads": 4}
    )
    with pytest.raises(ConfigError, match="neither divides nor is a multiple of the KV heads"):
        Shard.of(odd, 0, 6)
    with pytest.raises(ConfigError, match="does not divide intermediate_size 28672"):
        Shard.of(ModelConfig.from_dict({**LLAMA_31_70B, "num_attention_heads": 96}), 0, 96)
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"{count + 1} CUDA devices, {count} found"):
        check_devices(torch.device("cuda"), count + 1)
    check_devices(torch.device("cpu"), 8)  # CPU ranks share the host


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2", "phi3", "gpt_oss"])
def test_experts_windows_and_fused_tensors_over_two_ranks(family, tmp_path):
    """Qwen3-MoE: each expert's intermediate dimension halves (32 -> 16 rows a rank), the
    router and the dense layer as usual; Gemma 2: window 8 and soft-caps on each rank's heads;
    Phi-3: each rank reads its q, k, v (gate, up) rows out of the fused tensors; gpt-oss: each
    rank its heads' sinks and its span of the interleaved gate_up columns, the o and down
    biases added once. Roomy, then under recompute preemption."""
    builders = {"qwen3_moe": build_qwen3_moe, "gemma2": build_gemma2, "phi3": build_phi3,
                "gpt_oss": build_gpt_oss}  # fmt: skip
    path = builders[family](tmp_path)
    expected = hf_greedy(path, PROMPTS)
    # two KV groups: blocks of half the bytes
    num_blocks = 20 if family in ("gemma2", "gpt_oss") else 10
    with tp_llm(path, num_blocks=num_blocks, preemption_mode="recompute") as llm:
        if family == "qwen3_moe":
            experts = llm.executor.model.layers[0].experts
            assert tuple(experts.gate_up.shape) == (6, 2 * 16, 64)
            assert tuple(experts.down.shape) == (6, 64, 16)
        if family == "gpt_oss":  # 32 intermediate rows -> 16 a rank; 2 of 4 heads' sinks
            layer = llm.executor.model.layers[0]
            assert tuple(layer.experts.gate_up_bias.shape) == (4, 2 * 16)
            assert tuple(layer.sinks.shape) == (2,)
        assert greedy(llm, PROMPTS[:3]) == expected[:3]
        assert greedy(llm, PROMPTS) == expected
        assert llm.stats()["num_preemptions"] > 0
        assert_all_free(llm)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16: experts not packed")
def test_bf16_experts_packed_from_each_rank_slices(tmp_path):
    """The CPU backend packs each rank's half of every bf16 expert (packed_experts.py)."""
    path = build_qwen3_moe(tmp_path)
    prompts = random_prompts([1, 6, 17, 33], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True)
    with tp_llm(path, dtype="bfloat16", attention_backend="cpu") as llm:
        packed = llm.executor.model.layers[0].experts.packed
        assert (len(packed.gate_up), len(packed.down), packed.intermediate) == (6, 6, 16)
        assert_follows_transformers(path, prompts, greedy(llm, prompts, params))
        assert_all_free(llm)


def test_sliding_window_groups_over_two_ranks_swapped_hits_samples_beams(tmp_path):
    """Gemma 3 with three sliding layers (window 8) and one full: four KV groups, each rank
    holding its KV head of every group's blocks; swap preemption with a CPU tier, prefix hits,
    forks and beams, greedy-equal to transformers."""
    sliding, full = "sliding_attention", "full_attention"
    path = build_gemma3(
        tmp_path, seed=31, num_hidden_layers=4, num_key_value_heads=2,
        layer_types=[sliding, sliding, full, sliding],
    )  # fmt: skip
    expected = hf_greedy(path, PROMPTS)
    args = dict(num_blocks=36, max_num_batched_tokens=16, swap_space=1 << 20)
    with tp_llm(path, preemption_mode="swap", **args) as llm:
        assert len(llm.scheduler.block_manager.groups) == 4
        assert llm.executor.kv_cache.shape[0] == 1 and llm.executor.kv_cache.shape[4] == 1
        assert greedy(llm, PROMPTS) == expected
        stats = llm.stats()
        assert stats["num_swap_preemptions"] > 0 and stats["num_swapped_in_blocks"] > 0, stats
        assert greedy(llm, PROMPTS[-2:]) == expected[-2:]
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        check_beams_and_samples(llm, path)
        assert_all_free(llm)
