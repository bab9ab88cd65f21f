"""The AMX cache layout (kernels/cpu_tiles.py): its torch twins on any host, its C write on
the host's build and AVX2's, and the tile attention kernel against the token-major twin and
dense attention over the same values: the host's build (AMX tiles on an AMX host) and Cooper
Lake's (AVX512-BF16 dot products, no AMX) wherever the CPU has AVX512-BF16."""

import dataclasses

import pytest
import torch
from kvpager.kernels import cpu_tiles
from kvpager.kernels.cpu_tiles import (
    from_tiles,
    paged_attention_tiles,
    paged_attention_tiles_ref,
    reshape_and_cache_tiles,
    reshape_and_cache_tiles_ref,
    to_tiles,
)
from kvpager.kernels.isa import isa_flags
from kvpager.kernels.reference import paged_attention_ref, reshape_and_cache_ref

from tests.kernels.test_paged_attention import (
    DECODE,
    MIXED,
    PREFILL,
    assert_close,
    dense_attention,
    make_batch,
)


@pytest.fixture(params=["native", "cooperlake"])
def tile_kernel(request, monkeypatch):
    """cpu_tiles with its library built for `march`: the host's, or AVX512-BF16 without AMX
    (its own half, kernels/cpu/tiles_dpbf16.h, which an AMX host's build does not run)."""
    march = request.param
    if march != "native" and "avx512_bf16" not in isa_flags():
        pytest.skip("no AVX512-BF16 on this host")
    library = cpu_tiles.load(march)
    if library is None or library.tiles_ready() != 0:
        pytest.skip(f"no tile kernel in the {march} build on this host")
    monkeypatch.setattr(cpu_tiles, "load", lambda march_=None: library)
    monkeypatch.setattr(cpu_tiles, "available", lambda: True)
    return march


def _tiled(batch):
    """The batch with its caches in the tile layout (same values)."""
    return dataclasses.replace(
        batch,
        key_cache=to_tiles(batch.key_cache, False),
        value_cache=to_tiles(batch.value_cache, True),
    )


def test_the_layout_puts_each_value_where_the_kernel_reads_it():
    """K: a kv head's slab is [dim pairs][tokens][2]; V: [token pairs][dims][2]."""
    blocks, block_size, heads, dim = 3, 16, 2, 32
    cache = torch.randn(blocks, block_size, heads, dim)
    slab = block_size * dim
    keys, values = to_tiles(cache, False).flatten(1), to_tiles(cache, True).flatten(1)
    for b, t, h, d in [(0, 0, 0, 0), (1, 5, 1, 7), (2, 15, 1, 31), (0, 9, 0, 16)]:
        assert keys[b, h * slab + (d // 2) * block_size * 2 + t * 2 + d % 2] == cache[b, t, h, d]
        assert values[b, h * slab + (t // 2) * dim * 2 + d * 2 + t % 2] == cache[b, t, h, d]
    for value in (False, True):
        assert torch.equal(from_tiles(to_tiles(cache, value), value), cache)


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_the_write_lays_rows_out_as_the_twins_do(march, monkeypatch):
    """The C write (the host's build and AVX2's) = the tile twin = the token-major write then
    to_tiles; negative slots are skipped; rows may be views into a wider qkv row."""
    library = cpu_tiles.load(march)
    if library is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_tiles, "load", lambda march_=None: library)
    gen = torch.Generator().manual_seed(3)
    blocks, block_size, heads, dim, tokens = 6, 32, 3, 64, 40
    qkv = torch.randn(tokens, 5 * heads * dim, generator=gen).bfloat16()
    key = qkv[:, : heads * dim].view(tokens, heads, dim)
    value = qkv[:, 2 * heads * dim : 3 * heads * dim].view(tokens, heads, dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1
    start = torch.randn(blocks, block_size, heads, dim, generator=gen).bfloat16()
    tiled = (to_tiles(start, False), to_tiles(start, True))
    by_c, by_twin, token_major = (
        (tiled[0].clone(), tiled[1].clone()),
        (tiled[0].clone(), tiled[1].clone()),
        (start.clone(), start.clone()),
    )
    reshape_and_cache_tiles(key, value, *by_c, slots)
    reshape_and_cache_tiles_ref(key, value, *by_twin, slots)
    reshape_and_cache_ref(key, value, *token_major, slots)
    for is_value in (0, 1):
        expected = to_tiles(token_major[is_value], bool(is_value))
        assert torch.equal(by_twin[is_value], expected)
        assert torch.equal(by_c[is_value], expected)
    assert not torch.equal(by_c[0], tiled[0])  # it wrote something


# (head_dim, num_heads, num_kv_heads, block_size): SmolLM2's 64/9/3, Qwen3's test shape, a
# group of one and of sixteen, long blocks
CONFIGS = [(64, 9, 3, 16), (32, 4, 2, 16), (128, 8, 1, 32), (64, 16, 1, 16), (64, 4, 4, 64)]
# chunks of a group's size or less run a unit per token; longer ones 16 tokens a unit, the
# last one short; contexts before them cached or not
UNITS = ([1, 2, 3, 4, 9, 16, 17, 40], [30, 2, 50, 80, 9, 300, 17, 47])


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "block_size"), CONFIGS)
@pytest.mark.parametrize("case", [DECODE, MIXED, PREFILL, UNITS])
@pytest.mark.usefixtures("tile_kernel")
def test_tile_attention_equals_the_token_major_twin(
    case, head_dim, num_heads, num_kv_heads, block_size
):
    """Every row on tiles, decode tokens and prefill chunks alike: the token-major twin's
    answer on the same values, and dense attention's."""
    batch = make_batch(*case, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cpu")
    scale = head_dim**-0.5
    out = paged_attention_tiles(*_tiled(batch).args(scale))
    assert out.dtype == torch.bfloat16
    assert_close("vs twin", out, paged_attention_ref(*batch.args(scale)), torch.bfloat16)
    assert_close("vs dense", out, dense_attention(batch, scale), torch.bfloat16)
    twin = paged_attention_tiles_ref(*_tiled(batch).args(scale))
    assert_close("vs tile twin", out, twin, torch.bfloat16)


@pytest.mark.parametrize("case", [DECODE, MIXED, UNITS])
@pytest.mark.usefixtures("tile_kernel")
def test_every_thread_count_gives_the_same_bits(case):
    """Threads take what is left of each other's runs (a unit is computed whole by whichever
    thread takes it), so 1 thread, 3, and more threads than units agree bit for bit."""
    batch = _tiled(make_batch(*case, 8, 2, 64, 16, torch.bfloat16, "cpu"))
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 3, 64):
            torch.set_num_threads(count)
            outs.append(paged_attention_tiles(*batch.args(0.125)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("case", [MIXED, PREFILL, UNITS])
@pytest.mark.parametrize("window", [1, 17, 100])
@pytest.mark.usefixtures("tile_kernel")
def test_windows_match_the_twin(window, case):
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    args = batch.args(0.125)
    out = paged_attention_tiles(*_tiled(batch).args(0.125), window=window)
    assert_close("window", out, paged_attention_ref(*args, window=window), torch.bfloat16)


def _fp32_tile_output(batch, scale):
    """The kernel's own fp32 output (before the rounding to bf16), or None without the kernel."""
    tiled = _tiled(batch)
    return cpu_tiles._tile_attention(
        batch.query, tiled.key_cache, tiled.value_cache, batch.block_tables, batch.cu_seqlens_q,
        batch.seq_lens, scale, 0, 0.0,
    )  # fmt: skip


@pytest.mark.parametrize("case", [DECODE, MIXED, UNITS])
def test_rows_are_within_the_outputs_rounding_of_the_fp32_twin(case, tile_kernel):
    """Before the output's own rounding to bf16, on the same bf16 values, decode units and
    prefill units alike: the AVX512-BF16 half keeps P in fp32 and matches the fp32 twin to
    ~1e-6; on AMX tiles P rounds to bf16 once (as torch's CPU flash attention and vLLM's AMX
    kernel round it), and the kernel is nearer the twin than that rounding leaves the twin."""
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    out = _fp32_tile_output(batch, 0.125)
    twin = paged_attention_ref(*dataclasses.replace(batch, query=batch.query.float()).args(0.125))
    on_amx = tile_kernel == "native" and "amx_tile" in isa_flags()
    bound = (twin.bfloat16().float() - twin).abs().max() if on_amx else 1e-5
    assert out is not None and (out - twin).abs().max() < bound


@pytest.mark.parametrize("case", [DECODE, MIXED, UNITS])
@pytest.mark.usefixtures("tile_kernel")
def test_bf16_rows_out_are_the_fp32_rows_rounded(case):
    """The bf16 entry point stores each row rounded to nearest even: bit for bit the fp32
    entry's output converted by torch, decode units and prefill units alike (the layer's
    attention output without a conversion pass)."""
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    tiled = _tiled(batch)
    args = (batch.query, tiled.key_cache, tiled.value_cache, batch.block_tables,
            batch.cu_seqlens_q, batch.seq_lens, 0.125, 0, 0.0)  # fmt: skip
    rows = cpu_tiles._tile_attention(*args, None, torch.bfloat16)
    assert rows is not None and rows.dtype == torch.bfloat16
    assert torch.equal(rows, cpu_tiles._tile_attention(*args).bfloat16())
    assert torch.equal(paged_attention_tiles(*tiled.args(0.125)), rows)


@pytest.mark.usefixtures("tile_kernel")
def test_decode_calls_take_one_token_a_sequence():
    batch = make_batch(*DECODE, 9, 3, 64, 16, torch.bfloat16, "cpu")
    tiled = _tiled(batch)
    out = cpu_tiles.paged_decode_tiles(
        batch.query, tiled.key_cache, tiled.value_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    assert torch.equal(out, _fp32_tile_output(batch, 0.125))


@pytest.mark.parametrize("case", [DECODE, MIXED])
@pytest.mark.usefixtures("tile_kernel")
def test_garbage_past_a_sequence_is_never_read(case):
    """Slots after a sequence's last token (and padding blocks) may hold NaN: 0 * NaN would
    poison the output if the kernel let them into p.V."""
    batch = make_batch(*case, 9, 3, 64, 16, torch.bfloat16, "cpu")
    clean = paged_attention_tiles(*_tiled(batch).args(0.125))
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        last = batch.block_tables[seq, (seq_len - 1) // 16]
        batch.key_cache[last, (seq_len - 1) % 16 + 1 :] = float("nan")
        batch.value_cache[last, (seq_len - 1) % 16 + 1 :] = float("nan")
    batch.block_tables[:, -1] = 0  # padding points anywhere
    out = paged_attention_tiles(*_tiled(batch).args(0.125))
    assert torch.equal(out, clean)


@pytest.mark.usefixtures("tile_kernel")
def test_query_rows_may_be_apart():
    batch = make_batch(*MIXED, 9, 3, 64, 16, torch.bfloat16, "cpu")
    wide = torch.randn(batch.query.shape[0], 15 * 64).bfloat16()
    wide[:, : 9 * 64] = batch.query.flatten(1)
    apart = dataclasses.replace(_tiled(batch), query=wide[:, : 9 * 64].view(-1, 9, 64))
    assert torch.equal(
        paged_attention_tiles(*apart.args(0.125)), paged_attention_tiles(*_tiled(batch).args(0.125))
    )


@pytest.mark.usefixtures("tile_kernel")
def test_a_batch_its_starts_do_not_cover_is_refused():
    batch = make_batch(*MIXED, 9, 3, 64, 16, torch.bfloat16, "cpu")
    short = dataclasses.replace(_tiled(batch), cu_seqlens_q=batch.cu_seqlens_q - 1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_tiles(*short.args(0.125))


def test_the_kernel_declines_soft_capping():
    """A soft-capped layer keeps the token-major layout; the tile kernel says no to one."""
    batch = make_batch(*MIXED, 4, 2, 32, 16, torch.bfloat16, "cpu")
    library = cpu_tiles.load()
    if library is None:
        pytest.skip("no C compiler")
    tiled = _tiled(batch)
    out = torch.empty(batch.query.shape)
    ptrs = (t.data_ptr() for t in (tiled.key_cache, tiled.value_cache, batch.block_tables))
    key, value, tables = ptrs
    status = library.paged_attention_tiles_bf16(
        batch.query.data_ptr(), batch.query.stride(0), key, value, tables,
        batch.block_tables.stride(0), batch.cu_seqlens_q.data_ptr(), batch.seq_lens.data_ptr(),
        out.data_ptr(), len(batch.seq_lens), 4, 2, 32, 16, 1, 0.125, 0, 5.0, None,
    )  # fmt: skip
    assert status == -1


def test_soft_capping_takes_the_twin():
    """The layout is not picked for a soft-capped model; a capped call still answers right."""
    batch = make_batch(*MIXED, 4, 2, 32, 16, torch.bfloat16, "cpu")
    out = paged_attention_tiles(*_tiled(batch).args(0.125), softcap=5.0)
    assert_close(
        "softcap", out, paged_attention_ref(*batch.args(0.125), softcap=5.0), torch.bfloat16
    )


def test_the_layout_is_picked_only_where_it_fits():
    fits = cpu_tiles.fits
    bf16 = torch.bfloat16
    assert not fits(torch.float32, torch.float32, 9, 3, 64, 16)
    assert not fits(bf16, torch.float8_e4m3fn, 9, 3, 64, 16)
    assert not fits(bf16, bf16, 9, 3, 48, 16)  # head_dim not a multiple of 32
    assert not fits(bf16, bf16, 9, 3, 64, 8)  # blocks under 16 tokens
    assert not fits(bf16, bf16, 32, 1, 64, 16)  # 32 query heads a kv head
    assert not fits(bf16, bf16, 9, 3, 64, 16, softcap=50.0)
    assert fits(bf16, bf16, 9, 3, 64, 16) == cpu_tiles.available()


def test_a_build_without_amx_or_avx512_bf16_declines():
    """AVX2's build has the write but no tile kernel: it says so, and the layout is not picked."""
    library = cpu_tiles.load("x86-64-v3")
    if library is None:
        pytest.skip("no C compiler")
    assert library.tiles_ready() == -1
