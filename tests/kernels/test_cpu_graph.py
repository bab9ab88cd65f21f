"""kernels/cpu_graph.py: a region of C kernel calls replays with new input values as the region
itself computes them, its intermediates in buffers shared as an allocator shares them, and a
region that computes, changes or reads tensors outside the kernels is refused."""

import ctypes
import ctypes.util
import threading

import pytest
import torch
from kvpager.kernels import cpu_graph, cpu_layer_ops

needs_kernels = pytest.mark.skipif(cpu_layer_ops.load() is None, reason="no C compiler")
HIDDEN, ROWS, LAYERS = 64, 5, 4


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(HIDDEN, generator=generator).to(dtype) + 0.5 for _ in range(LAYERS)]


def _region(x: torch.Tensor, weights: list[torch.Tensor]):
    def region() -> torch.Tensor:
        delta = None
        residual = x
        for weight in weights:
            h, residual = cpu_layer_ops.add_rms_norm(residual, delta, weight, 1e-6)
            delta = cpu_layer_ops.add_rms_norm(h, None, weight, 1e-5)[0]
        return cpu_layer_ops.add_rms_norm(residual, delta, weights[0], 1e-6)[0]

    return region


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replay_computes_what_the_region_computes_for_new_inputs(dtype):
    weights = _weights(dtype)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    region = _region(x, weights)
    graph = cpu_graph.capture(region, [x])
    assert len(graph.calls) == 2 * LAYERS + 1
    for seed in (2, 3):
        fresh = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x.copy_(fresh)
        replayed = graph.replay().clone()
        x.copy_(fresh)
        assert torch.equal(replayed, region())
    buffers = {b.untyped_storage().data_ptr() for b in graph.buffers}
    assert graph.output.untyped_storage().data_ptr() in buffers  # the next replay overwrites it


@needs_kernels
def test_intermediates_share_buffers_once_dead():
    weights = _weights(torch.float32)
    x = torch.randn(ROWS, HIDDEN)
    graph = cpu_graph.capture(_region(x, weights), [x])
    # 2 * LAYERS + 1 outputs of one size: at most three live at once (h, delta, the next h)
    assert len(graph.buffers) <= 3
    assert graph.num_bytes <= 3 * ROWS * HIDDEN * 4
    pointers = {args[3] for _, args, _ in graph.calls}  # each call's out
    assert pointers <= {b.data_ptr() for b in graph.buffers}


@needs_kernels
@pytest.mark.parametrize(
    "step, refusal",
    [
        (lambda t: t + 1, "computes outside the kernels"),
        (lambda t: t.mul_(2), "in place"),
        (lambda t: t.__setitem__(0, 1.0), "in place"),
        (lambda t: torch.add(t, 1, out=t), "in place"),  # its result shares t's memory
        (lambda t: int(t[0, 0]), "reads tensor data"),
        (lambda t: t.tolist(), "reads tensor data"),
    ],
)
def test_a_region_that_works_outside_the_kernels_is_refused(step, refusal):
    weight = _weights(torch.float32)[0]
    x = torch.randn(ROWS, HIDDEN)

    def region() -> torch.Tensor:
        h = cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)[0]
        step(h)
        return h

    with pytest.raises(cpu_graph.CaptureError, match=refusal):
        cpu_graph.capture(region, [x])


@needs_kernels
def test_constants_may_be_read_and_views_or_no_op_conversions_pass():
    weight = _weights(torch.float32)[0]
    x, lengths = torch.randn(ROWS, HIDDEN), torch.arange(ROWS + 1, dtype=torch.int32)

    def region() -> torch.Tensor:
        assert int(lengths[-1]) == ROWS  # a read of a constant
        rows = x.view(ROWS, 2, HIDDEN // 2).reshape(ROWS, HIDDEN).float().contiguous()
        return cpu_layer_ops.add_rms_norm(rows, None, weight, 1e-6)[0]

    graph = cpu_graph.capture(region, [x], constants=[lengths])
    x.copy_(torch.randn(ROWS, HIDDEN))
    assert torch.equal(graph.replay(), cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)[0])


def test_a_region_without_kernel_calls_is_refused():
    with pytest.raises(cpu_graph.CaptureError, match="no kernel calls"):
        cpu_graph.capture(lambda: torch.empty(3), [])


@needs_kernels
def test_calls_from_other_threads_are_not_recorded():
    weight = _weights(torch.float32)[0]
    x, other = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, HIDDEN)

    def region() -> torch.Tensor:
        thread = threading.Thread(
            target=cpu_layer_ops.add_rms_norm, args=(other, None, weight, 1e-6)
        )
        thread.start()
        thread.join()
        return cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)[0]

    graph = cpu_graph.capture(region, [x])
    assert len(graph.calls) == 1


@needs_kernels
def test_a_status_other_than_at_capture_is_an_error():
    weight = _weights(torch.float32)[0]
    x = torch.randn(ROWS, HIDDEN)
    graph = cpu_graph.capture(_region(x, [weight]), [x])
    fn, args, status = graph.calls[0]
    calls = [(fn, args, status + 1), *graph.calls[1:]]
    tampered = cpu_graph.CallGraph(calls, graph.output, graph.buffers)
    for runner in (True, False):  # from C, and from Python
        if not runner:
            tampered.records = None
        with pytest.raises(cpu_graph.ReplayError, match="another status"):
            tampered.replay()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_runner_makes_the_calls_python_would(dtype):
    weights = _weights(dtype)
    x = torch.randn(ROWS, HIDDEN).to(dtype)
    graph = cpu_graph.capture(_region(x, weights), [x])
    if cpu_graph._runner() is not None:
        assert graph.records is not None  # every call here fits its records
    fresh = torch.randn(ROWS, HIDDEN).to(dtype)
    x.copy_(fresh)
    from_c = graph.replay().clone()
    graph.records = None
    x.copy_(fresh)
    assert torch.equal(graph.replay(), from_c)


def test_calls_that_do_not_fit_the_runner_replay_from_python():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.pow.argtypes = [ctypes.c_double, ctypes.c_double]  # doubles: not the records' kinds
    assert cpu_graph._records([(libm.pow, (2.0, 3.0), 8)]) is None


@needs_kernels
def test_a_library_loaded_during_capture_is_captured_on_a_second_run(monkeypatch):
    weight = _weights(torch.float32)[0]
    x = torch.randn(ROWS, HIDDEN)
    loaded = list(cpu_graph.loaded_libraries())
    runs = []

    def region() -> torch.Tensor:
        runs.append(len(runs))
        return cpu_layer_ops.add_rms_norm(x, None, weight, 1e-6)[0]

    # the first run sees one library fewer loaded than when it ends (as at a first decode step)
    libraries = iter([loaded[:-1], loaded, loaded, loaded])
    monkeypatch.setattr(cpu_graph, "loaded_libraries", lambda: next(libraries, loaded))
    graph = cpu_graph.capture(region, [x])
    assert len(runs) == 2 and len(graph.calls) == 1
