"""fp32 linears on AMX tiles (kernels/cpu/amx_linear_f32.c): each value as three bf16 parts, the
six largest part products summed in float32. Held to float64 truth beside its twin, F.linear in
float32: the kernel must be as exact as fp32's own matmul."""

import pytest
import torch
import torch.nn.functional as F
from kvpager.kernels import small_linear

SHAPES = [(96, 64), (960, 576), (576, 1536), (3072, 576)]


def _planes(out_f: int, in_f: int, seed: int):
    if small_linear.load_amx_f32() is None or not small_linear.amx_available():
        pytest.skip("no AMX build, or the OS refused this process the tile registers")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
    planes = small_linear.split_planes(weight)
    assert planes is not None and planes.dtype == torch.float32
    return weight, planes, gen


def test_three_parts_sum_back_to_the_value():
    """Every fp32 value of magnitude 2^-100 to 2^126 (a model's weights, activations) and 0."""
    gen = torch.Generator().manual_seed(1)
    scales = torch.exp2(torch.randint(-100, 126, (4096,), generator=gen).float())
    values = torch.randn(4096, generator=gen) * scales
    values = torch.cat([values, torch.tensor([1.0, -1.0 / 3, 0.0, 2.0**126 * 1.999])])
    first, second, third = small_linear.bf16_parts(values)
    assert all(part.dtype == torch.bfloat16 for part in (first, second, third))
    total = first.double() + second.double() + third.double()
    assert torch.equal(total, values.double())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 31, 32, 33, 48, 64, 100, 129, 300])
def test_tiles_are_as_exact_as_fp32(shape, rows):
    """Every tiling (one tile of fewer than 16 rows, two, whole groups of 32 and a tail, past
    a 128-row chunk), with and without a bias: the largest error against float64 is within
    a small factor of the float32 twin's own (0.7-2.5x measured)."""
    weight, planes, gen = _planes(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen) if rows % 2 else None
    out = small_linear.tile_linear_f32(x, planes, bias)
    truth = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    twin = F.linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == twin.shape
    if rows:
        error, twin_error = (out - truth).abs().max(), (twin - truth).abs().max()
        assert error <= 4 * twin_error + 1e-7
        assert error <= 1e-5 * truth.abs().max()


def test_rows_do_not_depend_on_the_batch():
    """Each row's sums run over k in the same order whatever the tile heights, so a row
    computed in a batch is bitwise the row computed in a smaller one."""
    _, planes, gen = _planes(960, 576, seed=3)
    x = torch.randn(150, 576, generator=gen)
    batch = small_linear.tile_linear_f32(x, planes, None)
    for size in (1, 3, 16, 17, 32, 33, 129):
        assert torch.equal(small_linear.tile_linear_f32(x[:size], planes, None), batch[:size])


def test_shapes_off_the_tiles_are_refused():
    """split_planes refuses what the layout cannot hold; the C entry point answers such shapes
    with an error, not a wrong product."""
    _planes(64, 64, seed=0)  # skips without AMX
    assert small_linear.split_planes(torch.randn(40, 64)) is None  # out not a multiple of 32
    assert small_linear.split_planes(torch.randn(64, 48)) is None  # in not of 32
    assert small_linear.split_planes(torch.randn(64, 64).bfloat16()) is None
    library = small_linear.load_amx_f32()
    x, out, w = torch.zeros(2, 48), torch.empty(2, 64), torch.zeros(3 * 64 * 48).bfloat16()
    assert library.amx_linear_f32(x.data_ptr(), 2, 48, w.data_ptr(), 64, None, out.data_ptr(), 2)
    # through the Python entry, such a status is an error that names the shape, not a result
    view = small_linear.PackedView(w, w.data_ptr(), 64, 48, torch.float32, small_linear.AMX_COLS)
    with pytest.raises(AssertionError, match="shapes the caller should have checked"):
        small_linear._run(library.amx_linear_f32, x, view, None)
