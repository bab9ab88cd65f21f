"""The small-row linear (kernels/small_linear.py) against its twin (small_linear_ref), reading
oneDNN's packed buffer in place: the host's build and AVX2's (x86-64-v3), bf16 and fp32, row
counts across its 4-row register blocks, with and without bias.

Tolerance: the kernel sums the same float32 products as the twin in another order (by 16- and
64-column blocks, k ascending), so fp32 results agree to a few float32 ulps of the row's
magnitude (|a - b| <= 1e-5 * (1 + |ref|) with K <= 1536); bf16 results are the same float32 sums
rounded once to bf16, so they agree to one bf16 ulp (where a sum lands on a rounding boundary)."""

import pytest
import torch
from kvpager.engine.model.linear import pack_weight
from kvpager.kernels import small_linear
from kvpager.kernels.reference import small_linear_ref

AVX2 = "x86-64-v3"
SHAPES = [(64, 32), (128, 64), (960, 576), (576, 1536)]


def _packed(out_f: int, in_f: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
    packed = pack_weight(weight)
    if packed is None:
        pytest.skip(f"no oneDNN packed path for {dtype} here")
    view = small_linear.view_packed(weight, packed)
    if view is None:
        pytest.skip("oneDNN chose another packed layout on this host")
    return weight, view, gen


@pytest.fixture(params=["native", AVX2])
def march(request):
    if small_linear.load(request.param) is None:
        pytest.skip(f"no C compiler or no {request.param} build here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9])
def test_kernel_matches_twin(march, dtype, shape, rows):
    weight, view, gen = _packed(*shape, dtype)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    bias = torch.randn(shape[0], generator=gen).to(dtype) if rows % 2 else None
    out = small_linear.small_linear(x, view, bias, march=march)
    ref = small_linear_ref(x, weight, bias)
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=1e-3)
        assert ((out.float() - ref.float()).abs() <= ulp).all()


def test_a_weight_oneDNN_laid_out_otherwise_is_refused():
    """Shapes oneDNN pads (out not a multiple of 64) get no view, and so keep oneDNN."""
    weight = torch.randn(72, 64)
    packed = pack_weight(weight)
    assert packed is None or small_linear.view_packed(weight, packed) is None


def test_the_view_checks_the_buffer_against_the_weight():
    """A packed buffer that is not this weight's reorder is refused (the layout check)."""
    weight, _, _ = _packed(128, 64, torch.float32)
    other = pack_weight(torch.randn(128, 64))
    assert small_linear.view_packed(weight, other) is None


def test_a_buffer_that_differs_in_its_last_block_is_refused():
    """The check reads the first and the last block: the order of blocks counts."""
    weight, _, _ = _packed(192, 64, torch.float32)
    swapped = torch.cat([weight[:64], weight[128:], weight[64:128]])  # blocks 1 and 2 swapped
    assert small_linear.view_packed(swapped, pack_weight(weight)) is None


@pytest.mark.parametrize("shape", SHAPES + [(3072, 576)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 6, 7, 8, 13, 37, 64, 70])
def test_avx2_fp32_tiles_match_the_twin(shape, rows):
    """AVX2's fp32 build (kernels/cpu/small_linear_avx2.h) over its tilings: one row over whole
    blocks, two or three over half blocks, more in even tiles of up to six over 16 columns."""
    if small_linear.load(AVX2) is None:
        pytest.skip("no C compiler or no AVX2 build here")
    weight, view, gen = _packed(*shape, torch.float32)
    x = torch.randn(rows, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen) if rows % 2 else None
    out = small_linear.small_linear(x, view, bias, march=AVX2)
    torch.testing.assert_close(out, small_linear_ref(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_avx2_fp32_rows_do_not_depend_on_the_batch():
    """Each output sums k in order whatever the tiling, so a row computed in a batch of 13 is
    bitwise the row computed alone (speculation's verify rows equal plain decoding's)."""
    if small_linear.load(AVX2) is None:
        pytest.skip("no C compiler or no AVX2 build here")
    weight, view, gen = _packed(960, 576, torch.float32)
    x = torch.randn(13, 576, generator=gen)
    batch = small_linear.small_linear(x, view, None, march=AVX2)
    for size in (1, 2, 3, 5):
        alone = small_linear.small_linear(x[:size], view, None, march=AVX2)
        assert torch.equal(alone, batch[:size])


@pytest.mark.parametrize("shape", SHAPES + [(3072, 576)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 13, 64, 97])
def test_bf16_blocks_match_the_twin(march, shape, rows):
    """bf16 weights blocked by block_bf16 (hosts where oneDNN packs no bf16), every tiling:
    the float32 sums of the twin, rounded once to bf16, so within one bf16 ulp of it."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    blocked = small_linear.block_bf16(weight)
    assert blocked is not None and blocked.packed.shape == (shape[0] // 64, shape[1], 64)
    x = torch.randn(rows, shape[1], generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16() if rows % 2 else None
    out = small_linear.small_linear_bf16w(x, blocked, bias, march=march)
    ref = small_linear_ref(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=1e-3)
    assert ((out.float() - ref.float()).abs() <= ulp).all()


def test_block_bf16_refuses_what_it_cannot_run():
    """Other dtypes and shapes (out not a multiple of 64, in not of 16) get no blocked copy."""
    assert small_linear.block_bf16(torch.randn(128, 64)) is None
    assert small_linear.block_bf16(torch.randn(72, 64).bfloat16()) is None
    assert small_linear.block_bf16(torch.randn(128, 40).bfloat16()) is None


AMX_SHAPES = [(96, 64), (960, 576), (576, 1536), (3072, 576)]


def _amx_view(out_f: int, in_f: int, seed: int = 0):
    """A bf16 weight and its view in oneDNN's AMX layout (32-column blocks), or a skip."""
    if not small_linear.amx_available():
        pytest.skip("no AMX build, or the OS refused this process the tile registers")
    weight, view, gen = _packed(out_f, in_f, torch.bfloat16, seed)
    assert view.cols == small_linear.AMX_COLS  # what oneDNN packs bf16 in where AMX runs
    return weight, view, gen


@pytest.mark.parametrize("shape", AMX_SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 100, 128, 300])
def test_amx_tiles_match_the_twin(shape, rows):
    """kernels/cpu/amx_linear.c over every tiling: one tile of fewer than 16 rows, two, whole
    groups of 32 and a tail of each height; within one bf16 ulp of the float32 twin."""
    weight, view, gen = _amx_view(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16() if rows % 2 else None
    out = small_linear.small_linear(x, view, bias)
    ref = small_linear_ref(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=1e-3)
    assert ((out.float() - ref.float()).abs() <= ulp).all()


def test_amx_rows_do_not_depend_on_the_batch():
    """Each row's sums run over k in the same order whatever the tile heights, so a row
    computed in a batch of 45 is bitwise the row computed alone or in a smaller batch."""
    _, view, gen = _amx_view(960, 576)
    x = torch.randn(45, 576, generator=gen).bfloat16()
    batch = small_linear.small_linear(x, view, None)
    for size in (1, 3, 16, 17, 32, 33):
        assert torch.equal(small_linear.small_linear(x[:size], view, None), batch[:size])


def test_amx_every_thread_count_gives_the_same_bits():
    """Threads take (row chunk, column block) items from each other's runs (steal.h), and an
    item is computed whole by whichever thread takes it: 1 thread, 3, and more threads than
    column blocks agree bit for bit, over several row chunks."""
    _, view, gen = _amx_view(960, 576)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    threads, outs = torch.get_num_threads(), []
    try:
        for count in (1, 3, 64):
            torch.set_num_threads(count)
            outs.append(small_linear.small_linear(x, view, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_the_amx_kernel_refuses_shapes_it_cannot_run():
    """Shapes out of the layout (out not a multiple of 32, in not of 32) are the caller's to
    keep from it; the C entry point answers them with an error, not a wrong product."""
    if not small_linear.amx_available():
        pytest.skip("no AMX here")
    library = small_linear.load_amx()
    x, out = torch.zeros(2, 48).bfloat16(), torch.empty(2, 64).bfloat16()
    w = torch.zeros(64, 48).bfloat16()
    assert (
        library.amx_linear_bf16(x.data_ptr(), 2, 48, w.data_ptr(), 64, None, out.data_ptr(), 2) == 1
    )
    assert (
        library.amx_linear_bf16(x.data_ptr(), 2, 64, w.data_ptr(), 40, None, out.data_ptr(), 2) == 1
    )
