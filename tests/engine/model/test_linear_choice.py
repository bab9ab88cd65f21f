"""Linears that pack once (engine/model/linear.py, engine/model/linear_choice.py): whatever
path a row count takes, the output is F.linear's (fp32 tightly, bf16 within a few ulps); a
mixed choice keeps the plain weight and runs each side; the timing runs once per shape;
small weights pack without timing; a tied lm_head packs a copy and leaves the embedding; small
row counts run the C kernel over the packed weight where it pays."""

import pytest
import torch
import torch.nn.functional as F
from kvpager.engine.memory import cpu_has_native_bf16
from kvpager.engine.model import linear, linear_choice
from kvpager.engine.model.decoder import Decoder
from kvpager.engine.model.linear import make_linear, onednn_packing_supported, pack_weight
from kvpager.engine.model.linear_choice import (
    AMX_F32_ROWS,
    AMX_KERNEL_ROWS,
    AMX_NARROW_COLS,
    AMX_NARROW_ROWS,
    AMX_PASS_ROWS,
    AVX2_KERNEL_ROWS,
    AVX512_KERNEL_ROWS,
    SMALL_ROWS,
    LinearChoice,
)
from kvpager.engine.model.loader import load_weights
from kvpager.engine.model_config import ModelConfig
from kvpager.kernels import small_linear
from kvpager.kernels.backend import get_kernel_ops

pytestmark = pytest.mark.skipif(
    not onednn_packing_supported(torch.empty(1)), reason="no oneDNN packed linear in this build"
)
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16: not packed"),
)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ROWS = (1, SMALL_ROWS, SMALL_ROWS + 1, 37)


@pytest.fixture(autouse=True)
def _no_fp32_tiles(monkeypatch):
    """oneDNN and the small-row kernel alone: fp32's tiles (AMX hosts) have their own test."""
    monkeypatch.setattr(linear, "F32_TILES_ON", False)


def weights(out_f: int, in_f: int, dtype: torch.dtype, bias: bool = False):
    gen = torch.Generator().manual_seed(out_f + in_f)
    weight = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
    return weight, (torch.randn(out_f, generator=gen).to(dtype) if bias else None)


def assert_matches_plain(fn, weight, bias) -> None:
    tol = TOLERANCE[weight.dtype]
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
        out = fn(x)
        assert out.dtype == weight.dtype and out.shape == (rows, weight.shape[0])
        expected = F.linear(x, weight, bias).float()
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("choice", [(True, True), (False, True), (True, False), (False, False)])
def test_every_choice_gives_plain_outputs(monkeypatch, dtype, choice):
    weight, bias = weights(320, 256, dtype, bias=True)
    forced = LinearChoice(*choice)
    monkeypatch.setattr(linear_choice, "_measure", lambda *args: forced)
    monkeypatch.setattr(linear_choice, "_cache", {})
    # oneDNN's side alone here: the small-row kernel has its own test below
    monkeypatch.setattr(linear, "with_small_kernel", lambda weight, packed, bias, fn, _: fn)
    calls = []
    packed_linear = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda *a: calls.append(a) or packed_linear(*a))
    fn, unused = make_linear(weight, bias, measure=True)
    # the plain weight may go only where every row count runs packed
    assert unused == (forced.packed_small and forced.packed_large)
    assert_matches_plain(fn, weight, bias)
    # each row count took its bucket's path
    ran_packed = [len(x) for x, *_ in calls]
    packed_at = {True: forced.packed_small, False: forced.packed_large}
    expected = [m for m in ROWS if packed_at[m <= SMALL_ROWS]]
    assert ran_packed == expected


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_measured_once_per_shape(monkeypatch, dtype):
    calls = []
    real = linear_choice._measure
    monkeypatch.setattr(linear_choice, "_cache", {})
    monkeypatch.setattr(linear_choice, "_measure", lambda *a: calls.append(a) or real(*a))
    weight, _ = weights(512, 256, dtype)
    threads = torch.get_num_threads()
    first, _ = make_linear(weight, None, measure=True)
    assert torch.get_num_threads() == threads  # timed on one thread, then put back
    other = weights(512, 256, dtype)[0] + 1  # same shape, other values
    second, _ = make_linear(other, None, measure=True)
    assert len(calls) == 1
    assert_matches_plain(first, weight, None)


def test_small_weights_pack_without_timing(monkeypatch):
    monkeypatch.setattr(linear_choice, "_measure", lambda *a: pytest.fail("timed a small weight"))
    weight, bias = weights(64, 64, torch.float32, bias=True)
    fn, unused = make_linear(weight, bias, measure=True)
    assert unused
    assert_matches_plain(fn, weight, bias)


def test_unmeasured_packs_and_unpacked_stays_plain(monkeypatch):
    monkeypatch.setattr(linear_choice, "_measure", lambda *a: pytest.fail("measure=False timed"))
    weight, _ = weights(512, 256, torch.float32)
    assert make_linear(weight, None, measure=False)[1]
    fn, unused = make_linear(weight, None, pack=False)
    assert not unused
    assert_matches_plain(fn, weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_tied_lm_head_packs_a_copy_and_keeps_the_embedding(monkeypatch, tiny_qwen2, dtype):
    config = ModelConfig.from_path(tiny_qwen2)
    assert config.tie_word_embeddings
    decoder = Decoder(config, dtype, 64, get_kernel_ops("torch"))
    load_weights(decoder, tiny_qwen2)
    embedding = decoder.embed_tokens.detach().clone()
    calls = []
    packed_linear = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda *a: calls.append(a) or packed_linear(*a))
    decoder.build_matmuls(pack=True)
    assert decoder.lm_head is decoder.embed_tokens
    assert torch.equal(decoder.embed_tokens, embedding)  # the table stays plain, unreleased
    rows = max(AVX2_KERNEL_ROWS, AMX_KERNEL_ROWS, AMX_NARROW_ROWS) + 1  # oneDNN's rows
    hidden = torch.randn(rows, config.hidden_size).to(dtype)
    tol = TOLERANCE[dtype]
    logits = decoder.compute_logits(hidden)
    assert len(calls) == 1  # the lm_head ran on its packed copy
    torch.testing.assert_close(logits, F.linear(hidden, embedding).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("kernel_wins", [True, False])
def test_small_rows_take_the_kernel_where_it_wins(monkeypatch, dtype, kernel_wins):
    """Rows up to the kernel's limit (the ISA's, or KERNEL_ROWS where it has none) run the C
    kernel over the packed buffer where timing picks it (once per shape), others oneDNN; the
    outputs are F.linear's either way."""
    if small_linear.load() is None:
        pytest.skip("no C compiler here")
    verdicts = []
    monkeypatch.setattr(linear_choice, "_kernel_cache", {})
    monkeypatch.setattr(linear_choice, "_measure", lambda *a: LinearChoice(True, True))
    monkeypatch.setattr(linear_choice, "_kernel_wins", lambda *a: verdicts.append(a) or kernel_wins)
    calls = []
    kernel = small_linear.small_linear
    monkeypatch.setattr(
        small_linear, "small_linear", lambda x, *a: calls.append(len(x)) or kernel(x, *a)
    )
    weight, bias = weights(320, 256, dtype, bias=True)
    fn, unused = make_linear(weight, bias, measure=True)
    make_linear(weight + 1, bias, measure=True)  # same shape: no second timing
    assert unused and len(verdicts) == 1
    assert_matches_plain(fn, weight, bias)
    view = small_linear.view_packed(weight, pack_weight(weight))
    limit = linear.view_rows(weight, view) if view else 0
    assert calls == ([m for m in ROWS if m <= limit] if kernel_wins else [])


def test_unmeasured_small_rows_follow_the_isa(monkeypatch):
    """Without timing the kernel runs where the host has the dtype's ISA (AVX-512 or AVX2 for
    fp32), up to that ISA's rows."""
    monkeypatch.setattr(linear_choice, "_kernel_wins", lambda *a: pytest.fail("timed"))
    calls = []
    kernel = small_linear.small_linear
    monkeypatch.setattr(
        small_linear, "small_linear", lambda x, *a: calls.append(len(x)) or kernel(x, *a)
    )
    weight, _ = weights(512, 256, torch.float32)
    fn, _ = make_linear(weight, None)
    assert_matches_plain(fn, weight, None)
    limit = linear.kernel_rows(weight) if small_linear.load() is not None else 0
    assert calls == [m for m in ROWS if m <= limit]


def test_bf16_on_amx_takes_the_tile_kernel_up_to_its_rows(monkeypatch):
    """On an AMX host oneDNN packs bf16 for the tile unit (32-column blocks) and the AMX
    kernel runs it up to AMX_KERNEL_ROWS rows, a narrow weight up to a prefill's
    AMX_NARROW_ROWS, a wide output (the lm_head) up to one pass of AMX_PASS_ROWS; oneDNN takes
    the rest. Outputs are F.linear's either way."""
    if not (cpu_has_native_bf16() and small_linear.amx_available()):
        pytest.skip("no AMX here")
    calls = []
    kernel = small_linear.small_linear
    monkeypatch.setattr(
        small_linear, "small_linear", lambda x, *a: calls.append(len(x)) or kernel(x, *a)
    )
    limits = ((512, AMX_NARROW_ROWS), (3072, AMX_KERNEL_ROWS), (49152, AMX_PASS_ROWS))
    for out_f, limit in limits:
        weight, bias = weights(out_f, 64, torch.bfloat16, bias=True)
        view = small_linear.view_packed(weight, pack_weight(weight))
        assert view is not None and view.cols == small_linear.AMX_COLS
        fn, _ = make_linear(weight, bias)
        calls.clear()
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(
                fn(x).float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2
            )
        assert calls == [1, limit]


def test_fp32_on_amx_takes_the_tiles_from_their_rows(monkeypatch):
    """On an AMX host an fp32 weight runs on the tile unit from AMX_F32_ROWS rows (its three
    bf16 parts, kernels/cpu/amx_linear_f32.c), the small-row kernel or oneDNN below; outputs
    are F.linear's within fp32's own error either way."""
    if small_linear.split_planes(torch.zeros(32, 32)) is None:
        pytest.skip("no AMX here")
    monkeypatch.setattr(linear, "F32_TILES_ON", True)
    calls = []
    tiles = small_linear.tile_linear_f32
    monkeypatch.setattr(
        small_linear, "tile_linear_f32", lambda x, *a: calls.append(len(x)) or tiles(x, *a)
    )
    weight, bias = weights(3072, 64, torch.float32, bias=True)
    fn, _ = make_linear(weight, bias)
    for rows in (1, AMX_F32_ROWS - 1, AMX_F32_ROWS, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fn(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == [AMX_F32_ROWS, 300]
    monkeypatch.setattr(linear, "F32_TILES_ON", False)
    fn(torch.randn(300, 64))
    assert calls == [AMX_F32_ROWS, 300]


def test_kernel_rows_follow_the_isa_and_the_output_size():
    """AVX-512 takes AVX512_KERNEL_ROWS rows (fp32; bf16 with AVX512-BF16), fp32 on AVX2 up
    to AVX2_KERNEL_ROWS, fewer on a wide output (an lm_head); a host with neither takes none."""
    layer, lm_head = torch.empty(3072, 576), torch.empty(49152, 576)
    assert linear.kernel_rows(layer, ["avx2", "fma", "avx512f"]) == AVX512_KERNEL_ROWS
    xeon = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]  # Sapphire Rapids' cores
    assert linear.kernel_rows(layer, xeon) == AVX512_KERNEL_ROWS
    assert linear.kernel_rows(layer.bfloat16(), xeon) == AVX512_KERNEL_ROWS  # unpacked for AMX
    assert linear.kernel_rows(lm_head, xeon) == linear.KERNEL_OUT_ELEMENTS // 49152
    assert linear.kernel_rows(layer, ["avx2", "fma"]) == AVX2_KERNEL_ROWS
    assert linear.kernel_rows(lm_head, ["avx2", "fma"]) == linear.KERNEL_OUT_ELEMENTS // 49152
    assert linear.kernel_rows(layer.bfloat16(), ["avx2", "fma", "avx512f"]) == 0
    assert linear.kernel_rows(layer.bfloat16(), ["avx512f", "avx512_bf16"]) == AVX512_KERNEL_ROWS
    assert linear.kernel_rows(layer, []) == 0
    assert linear.kernel_rows(layer.bfloat16(), amx=True) == AMX_KERNEL_ROWS
    assert linear.kernel_rows(lm_head.bfloat16(), amx=True) == AMX_PASS_ROWS
    narrow = torch.empty(AMX_NARROW_COLS, 1536).bfloat16()
    assert linear.kernel_rows(narrow, amx=True) == AMX_NARROW_ROWS
