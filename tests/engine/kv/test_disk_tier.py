"""The disk tier end to end on a tiny model: prefixes evicted past the CPU pool come back from
real files in tmp_path, token for token as computed fresh, and never from a wrong file."""

import os
from pathlib import Path

import pytest
from kvpager.engine import SamplingParams
from kvpager.engine.kv.block_hash import prompt_block_hashes
from kvpager.schemas.errors import ConfigError

from tests.engine.helpers import assert_all_free, make_llm, random_prompts
from tests.engine.worker.disk.test_disk_store import forge

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BLOCK_SIZE = 8
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers, K/V, slots, kv heads, head_dim, fp32
FILE_BYTES = 116 + 8 * BLOCK_SIZE + BLOCK_BYTES  # header, token ids, block
PROMPTS = random_prompts([40] * 8, seed=5)  # 5 full blocks each; 8 x 6 blocks > 16 + 4


def disk_llm(path, folder: Path, **overrides):
    args = dict(
        num_blocks=16,
        swap_space=4 * BLOCK_BYTES,
        kv_disk_dir=str(folder),
        kv_disk_bytes=1 << 20,
        kv_disk_key_file=str(folder.parent / "kv-disk.key"),  # not the user's cache dir
        block_size=BLOCK_SIZE,
    )
    args.update(overrides)
    return make_llm(path, **args)


def run_one_by_one(llm, prompts) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def disk_stats(llm) -> dict:
    stats = llm.stats()
    return {k: v for k, v in stats.items() if k.startswith("num_disk")}


def block_files(folder: Path, prompt: list[int], block_size: int = BLOCK_SIZE) -> list[Path]:
    (layout_folder,) = folder.iterdir()
    return [layout_folder / f"{h.hex()}.kvb" for h in prompt_block_hashes(prompt, block_size)]


@pytest.fixture
def written(tiny_llama, tmp_path):
    """A folder holding the first prompts' blocks (evicted past the CPU pool), and the fresh
    outputs of every prompt."""
    folder = tmp_path / "kv"
    with disk_llm(tiny_llama, folder) as llm:
        fresh = run_one_by_one(llm, PROMPTS)
        on_disk = llm.scheduler.block_manager.disk.on_disk
        assert all(h in on_disk for h in prompt_block_hashes(PROMPTS[0], BLOCK_SIZE))
        assert_all_free(llm)
    return folder, fresh


def test_prefix_evicted_past_cpu_comes_back_from_disk(tiny_llama, tmp_path):
    with disk_llm(tiny_llama, tmp_path / "kv") as llm:
        fresh = run_one_by_one(llm, PROMPTS)
        manager = llm.scheduler.block_manager
        first = prompt_block_hashes(PROMPTS[0], BLOCK_SIZE)[:4]
        assert not any(h in manager.cached or h in manager.cpu.cached for h in first)
        again = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens == 32  # 4 blocks: the last token always computes
        assert again.outputs[0].token_ids == fresh[0]
        assert disk_stats(llm)["num_disk_loaded_blocks"] == 4
        assert disk_stats(llm)["num_disk_failed_loads"] == 0
        assert_all_free(llm)
    plain = make_llm(tiny_llama, enable_prefix_caching=False)
    assert run_one_by_one(plain, PROMPTS[:2]) == fresh[:2]  # fresh really is fresh


def test_restart_over_the_same_folder(tiny_llama, written):
    folder, fresh = written
    with disk_llm(tiny_llama, folder) as llm:
        # one by one: the 4-block CPU pool holds one prompt's reads at a time
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS[:2]]
        assert [o.outputs[0].token_ids for o in outs] == fresh[:2]
        assert [o.num_cached_tokens for o in outs] == [32, 32]
        assert disk_stats(llm)["num_disk_loaded_blocks"] == 8
        assert_all_free(llm)


@pytest.mark.parametrize("change", [{"block_size": 4}, {"kv_cache_dtype": "bfloat16"}])
def test_a_file_of_another_layout_never_matches(tiny_llama, written, change):
    folder, fresh = written
    with disk_llm(tiny_llama, folder, **change) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert disk_stats(llm)["num_disk_loaded_blocks"] == 0
        if "block_size" in change:  # bfloat16 K/V may round a near-tie differently
            assert out.outputs[0].token_ids == fresh[0]
        assert_all_free(llm)
    assert len(list(folder.iterdir())) == 2  # one folder per layout


def test_a_file_of_another_model_never_matches(tiny_qwen2, written):
    folder, _ = written
    with disk_llm(tiny_qwen2, folder) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0 and disk_stats(llm)["num_disk_loaded_blocks"] == 0
        assert_all_free(llm)


def test_corrupt_and_truncated_files_are_misses(tiny_llama, written):
    folder, fresh = written
    files = block_files(folder, PROMPTS[0])
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF  # one flipped byte of K/V: the MAC catches it
    files[1].write_bytes(bytes(data))
    with open(block_files(folder, PROMPTS[1])[0], "r+b") as f:
        f.truncate(FILE_BYTES // 2)  # a torn write
    with disk_llm(tiny_llama, folder) as llm:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS[:2]]
        assert [o.outputs[0].token_ids for o in outs] == fresh[:2]
        assert [o.num_cached_tokens for o in outs] == [8, 0]  # up to the bad block
        stats = disk_stats(llm)
        assert stats["num_disk_failed_loads"] == 2 and stats["num_disk_rejected_files"] == 1
        assert_all_free(llm)
    assert not files[1].exists()  # dropped


@pytest.mark.parametrize("forger_key", ["crc32", b"forger's key".ljust(32)])
def test_a_forged_file_with_a_recomputed_checksum_is_refused(tiny_llama, written, forger_key):
    """Whoever can write the folder puts another block's K/V in a file and recomputes its
    check (the CRC-32 of version 1, or a keyed BLAKE3 under their own key): refused, deleted,
    counted, and the output is the undisturbed run's."""
    folder, fresh = written
    target, source = block_files(folder, PROMPTS[0])[1], block_files(folder, PROMPTS[1])[1]
    forge(target, source.read_bytes()[-BLOCK_BYTES:], forger_key)
    with disk_llm(tiny_llama, folder) as llm:
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == fresh[0]
        assert out.num_cached_tokens == 8  # the block before the forged one
        stats = disk_stats(llm)
        assert stats["num_disk_rejected_files"] == 1 and stats["num_disk_failed_loads"] == 1
        assert_all_free(llm)
    assert not target.exists()


def test_lru_by_bytes_keeps_within_the_bound(tiny_llama, tmp_path):
    folder = tmp_path / "kv"
    bound = 6 * FILE_BYTES
    with disk_llm(tiny_llama, folder, kv_disk_bytes=bound) as llm:
        fresh = run_one_by_one(llm, PROMPTS)
        llm.executor.disk.flush()
        files = [p for p in next(folder.iterdir()).iterdir()]
        assert len(files) == 6 and sum(p.stat().st_size for p in files) <= bound
        assert llm.executor.disk.num_bytes == 6 * FILE_BYTES
        kept = {bytes.fromhex(p.name[:64]) for p in files}
        assert kept == set(llm.executor.disk.index)
        # the most recently written six: the last the scheduler sent (oldest went first)
        assert kept == set(list(llm.scheduler.block_manager.disk.on_disk)[-6:])
        # what the scheduler still believes of the others is a miss, and the output is right
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == fresh[0]
        assert_all_free(llm)


def test_two_engines_share_a_folder(tiny_llama, tmp_path):
    folder = tmp_path / "kv"
    with disk_llm(tiny_llama, folder) as first:
        fresh = run_one_by_one(first, PROMPTS)
        first.executor.disk.flush()
        with disk_llm(tiny_llama, folder) as second:  # both open on one folder
            out = second.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
            assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == fresh[0]
            # the first evicts and writes more; the second hears of them when it rescans
            run_one_by_one(first, PROMPTS[4:] + random_prompts([40] * 4, seed=6))
            first.executor.disk.flush()
            second.executor.disk.rescan()  # (its writer does this when idle, every 5 s)
            second.generate(random_prompts([3], seed=7), GREEDY, use_tqdm=False)  # news
            out = second.generate([PROMPTS[5]], GREEDY, use_tqdm=False)[0]
            assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == fresh[5]
            assert_all_free(second)
        assert_all_free(first)
    names = os.listdir(next(folder.iterdir()))
    assert not [n for n in names if n.endswith(".tmp")]


def test_blocks_through_a_small_cpu_pool_in_one_step_come_back_exact(tiny_llama, tmp_path):
    # all prompts at once through a 2-block CPU pool: blocks reach the pool and leave it in
    # the same step, so their files are written from the device blocks they left
    with disk_llm(tiny_llama, tmp_path / "kv", swap_space=2 * BLOCK_BYTES) as llm:
        batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert disk_stats(llm)["num_disk_stored_blocks"] > 8
        again = run_one_by_one(llm, PROMPTS)
        assert disk_stats(llm)["num_disk_loaded_blocks"] > 0
        assert disk_stats(llm)["num_disk_failed_loads"] == 0
        assert_all_free(llm)
    plain = make_llm(tiny_llama, enable_prefix_caching=False)
    assert again == batch and batch[:2] == run_one_by_one(plain, PROMPTS[:2])


def test_the_disk_tier_needs_a_cpu_pool(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="swap_space"):
        disk_llm(tiny_llama, tmp_path / "kv", swap_space=0)


def test_fp8_blocks_come_back_from_disk_as_written(tiny_llama, tmp_path):
    """fp8 blocks travel as bytes: a quarter of fp32's, the same tokens back from disk."""
    fp8 = dict(kv_cache_dtype="fp8", swap_space=BLOCK_BYTES)  # 4 fp8 blocks, as fp32's 4 above
    with disk_llm(tiny_llama, tmp_path / "kv", **fp8) as llm:
        fresh = run_one_by_one(llm, PROMPTS)
        again = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens == 32
        assert again.outputs[0].token_ids == fresh[0]
        assert disk_stats(llm)["num_disk_loaded_blocks"] == 4
        assert_all_free(llm)
    (layout_folder,) = (tmp_path / "kv").iterdir()
    sizes = {f.stat().st_size for f in layout_folder.iterdir()}
    assert sizes == {116 + 8 * BLOCK_SIZE + BLOCK_BYTES // 4}


def test_the_disk_tier_beside_sliding_windows_is_refused(tmp_path):
    from tests.model_families import build_mistral

    model = build_mistral(tmp_path / "mistral")
    with pytest.raises(ConfigError, match="full-attention models only"):
        disk_llm(model, tmp_path / "kv")
