"""The executor picks the AMX cache layout (kernels/cpu_tiles.py) for a bf16 model on the cpu
backend where it fits, and the engine around it is unchanged: greedy tokens follow
transformers, whole-block swaps keep the tokens bit for bit, the disk tier's folders are
apart per layout, and kv_layout="token-major" keeps the token-major layout when asked."""

import pytest
import torch
from kvpager.engine import SamplingParams
from kvpager.engine.worker.disk.files import block_layout
from kvpager.kernels import cpu_tiles
from kvpager.schemas.errors import ConfigError

from tests import model_families
from tests.engine.helpers import assert_all_free, hf_generate, make_llm, random_prompts
from tests.engine.model.test_bf16 import MAX_TOKENS, assert_follows_transformers

needs_tiles = pytest.mark.skipif(
    not cpu_tiles.available(), reason="neither AMX nor AVX512-BF16 on this host"
)
# head_dim 32, 4 query heads over 2 kv heads: a shape the tiles take, at 16-token blocks
TILES = dict(dtype="bfloat16", attention_backend="cpu", block_size=16)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return model_families.build_qwen3(tmp_path_factory.mktemp("qwen3-tiles"))


@needs_tiles
def test_a_bf16_model_on_tiles_follows_transformers(tiny_qwen3):
    llm = make_llm(tiny_qwen3, **TILES)
    assert llm.executor.ops.kv_layout == cpu_tiles.LAYOUT
    prompts = random_prompts([1, 6, 17, 40], seed=5)  # 40: a chunk long enough for SDPA
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert_follows_transformers(tiny_qwen3, prompts, outputs)
    assert_all_free(llm)


@needs_tiles
def test_gpt_oss_sinks_and_windows_on_tiles_follow_transformers(tmp_path):
    """gpt-oss on the tile layout: each row's sink starts its running softmax, in decode and
    prefill units, sliding (window 8) and full layers alike (smaller weights, as test_bf16's
    gpt-oss: transformers' own bf16 stays within the tie margin of its fp32 then)."""
    path = model_families.build_gpt_oss(
        tmp_path, head_dim=32, bias_scale=0.3, initializer_range=0.1
    )
    llm = make_llm(path, **TILES)
    assert llm.executor.ops.kv_layout == cpu_tiles.LAYOUT
    _generates_and_frees(llm, path)


@needs_tiles
def test_swapped_blocks_come_back_in_the_layout_they_left(tiny_qwen3):
    """Swaps copy whole blocks, so the tile layout survives them: the same tokens as a run
    with room for everything."""
    prompts = random_prompts([5, 12, 17, 23, 31, 41], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    roomy = make_llm(tiny_qwen3, **TILES)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = make_llm(
        tiny_qwen3, **TILES, num_blocks=6, swap_space=1 << 20, preemption_mode="swap",
        enable_prefix_caching=False,
    )  # fmt: skip
    assert tight.executor.ops.kv_layout == cpu_tiles.LAYOUT
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == expected
    assert tight.stats()["num_swapped_in_blocks"] > 0
    assert_all_free(tight)
    assert_all_free(roomy)


def _generates_and_frees(llm, path) -> None:
    """A short greedy run against transformers (bf16: within the tie margin of its logits;
    float32: its `generate`, token for token), every block free after it."""
    prompts = random_prompts([1, 6, 17, 40], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if llm.executor.dtype == torch.bfloat16:
        assert_follows_transformers(path, prompts, outputs)
    else:
        expected = hf_generate(path, prompts, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert outputs == expected
    assert_all_free(llm)


def test_the_setting_keeps_the_token_major_layout(tiny_qwen3):
    llm = make_llm(tiny_qwen3, **TILES, kv_layout="token-major")
    assert llm.executor.ops.kv_layout == cpu_tiles.TOKEN_MAJOR
    _generates_and_frees(llm, tiny_qwen3)
    with pytest.raises(ConfigError, match="kv_layout"):
        make_llm(tiny_qwen3, **TILES, kv_layout="sideways")


def test_fp32_and_small_blocks_stay_token_major(tiny_qwen3):
    for overrides in ({"dtype": "float32"}, {"block_size": 8}):
        llm = make_llm(tiny_qwen3, **{**TILES, **overrides})
        assert llm.executor.ops.kv_layout == "token-major"
        _generates_and_frees(llm, tiny_qwen3)


def test_disk_folders_are_apart_per_layout(tiny_qwen3):
    shape, dtype = (2, 2, 16, 2, 32), torch.bfloat16
    token_major = block_layout(tiny_qwen3, shape, dtype, 0, 1)
    assert block_layout(tiny_qwen3, shape, dtype, 0, 1, "token-major") == token_major
    tiles = block_layout(tiny_qwen3, shape, dtype, 0, 1, cpu_tiles.LAYOUT)
    assert tiles.folder_name != token_major.folder_name
