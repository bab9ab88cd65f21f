"""A region's C kernel calls captured once and replayed: the CPU's counterpart of a CUDA graph.

Why: a decode step on CPU is ~300 synchronous kernel calls from Python, and the Python and torch
glue between them (wrappers, checks, output allocations, ctypes argument building) cost 10-20
ms a step on a 2-core host, 15-35% of it (benchmarks/reports/2026-12-07-xeon-amx-decode-
overheads/). A replay makes the same calls with the same arguments and nothing between them.

Capture runs the region once with every loaded kernel library's functions recording their calls
(kernels/cpu_build.py `loaded_libraries`), under a torch function mode that keeps every tensor
the region makes alive and refuses what a replay could not repeat:
- a torch op that computes (anything but a view, a no-op conversion or an empty buffer),
- an in-place torch op, an item assignment or an op writing into `out=`,
- a read of tensor data into Python (a branch on it), but of the tensors named constant.
Then each tensor the region made gets a buffer shared with others as an allocator would share
it (by size, free after its last call), every pointer argument into one moves into its buffer,
and the replay runs once more from the saved inputs and must give the capture's output bit for
bit. A region that fails any of this is not captured (CaptureError) and runs as it is.

What a replay assumes: the region's inputs are the tensors it was captured with (refill them
in place), and every other pointer it took (weights, the KV cache) still holds its tensor.
"""

import bisect
import ctypes
import functools
import platform
import threading
from collections.abc import Callable, Sequence

import torch
from kvpager.kernels.cpu_build import FLOAT, I64, PTR, load_library, loaded_libraries
from torch.overrides import TorchFunctionMode

# torch functions whose result is new memory the region may use: buffers kernels fill
_FRESH = {"empty", "empty_like", "new_empty"}
# functions that read tensor data into Python: a branch the replay would not take again
_READS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "numpy"}
# functions that return metadata, never tensor data nor memory (most calls a region makes:
# passed without a look, so a capture costs little more than the run it records)
_METADATA = {
    "__get__", "dim", "stride", "data_ptr", "is_contiguous", "element_size", "__len__", "size",
    "numel",
}  # fmt: skip


class CaptureError(RuntimeError):
    """The region does something a replay would not repeat (its message says what)."""


class ReplayError(RuntimeError):
    """A kernel returned another status than at capture (it declined, or ran out of memory)."""


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of t's memory; (0, 0) for a tensor without plain storage (oneDNN's
    opaque packed weights)."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Watch(TorchFunctionMode):
    """Keeps what the region allocates, refuses what it computes outside the kernels."""

    def __init__(self, constants: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []
        self.constants = {_storage(t)[0] for t in constants}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _METADATA:
            return func(*args, **kwargs)
        inputs = _tensors(args) + _tensors(list(kwargs.values()))
        if name in _READS and not all(_storage(t)[0] in self.constants for t in inputs):
            raise CaptureError(f"reads tensor data into Python ({name})")
        in_place = name.endswith("_") and not name.startswith("__")
        if name == "__setitem__" or in_place or kwargs.get("out") is not None:
            raise CaptureError(f"changes a tensor in place outside the kernels ({name})")
        out = func(*args, **kwargs)
        shared = {_storage(t)[0] for t in inputs}
        for t in _tensors(out):
            address = _storage(t)[0]
            if (address in shared and address) or not t.numel():
                continue
            if name not in _FRESH or not address:
                raise CaptureError(f"computes outside the kernels ({name})")
            self.made.append(t)
        return out


class _Recorder:
    """Every typed kernel function swapped for one that records its calls from this thread."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []  # (function, args, status)
        self.thread = threading.get_ident()
        self.swapped: list[tuple] = []

    def __enter__(self) -> "_Recorder":
        for library in loaded_libraries():
            for name, fn in list(vars(library).items()):
                if hasattr(fn, "argtypes") and fn.argtypes is not None:
                    setattr(library, name, self._recording(fn))
                    self.swapped.append((library, name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for library, name, fn in self.swapped:
            setattr(library, name, fn)

    def _recording(self, fn):
        def call(*args):
            status = fn(*args)
            if threading.get_ident() == self.thread:
                self.calls.append((fn, args, status))
            return status

        return call


# kernels/cpu/graph_runner.c: its call record's room, and the ABIs it runs on
RUNNER_INTS, RUNNER_FLOATS = 20, 4
RUNNER_ABIS = ("x86_64", "aarch64")


class _RecordedCall(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("status", ctypes.c_int64),
        ("ints", ctypes.c_int64 * RUNNER_INTS),
        ("floats", ctypes.c_float * RUNNER_FLOATS),
    ]


@functools.cache
def _runner():
    """graph_runner.c's run_calls, or None (another ABI, or no compiler)."""
    if platform.system() != "Linux" or platform.machine() not in RUNNER_ABIS:
        return None
    library = load_library("graph_runner", (("run_calls", (PTR, I64)),))
    return None if library is None else library.run_calls


def _records(calls: list[tuple]) -> ctypes.Array | None:
    """The calls as graph_runner.c's records, or None where one does not fit them."""
    records = (_RecordedCall * len(calls))()
    for record, (fn, args, status) in zip(records, calls):
        ints = [a or 0 for a, kind in zip(args, fn.argtypes) if kind in (PTR, I64)]
        floats = [a for a, kind in zip(args, fn.argtypes) if kind is FLOAT]
        if len(ints) > RUNNER_INTS or len(floats) > RUNNER_FLOATS:
            return None
        if len(ints) + len(floats) != len(args) or not all(isinstance(a, int) for a in ints):
            return None
        record.fn = ctypes.cast(fn, ctypes.c_void_p).value
        record.status = status
        record.ints[: len(ints)] = ints
        record.floats[: len(floats)] = floats
    return records


class CallGraph:
    """A captured region: `replay()` makes its kernel calls again and returns its output (a
    view of a buffer the next replay overwrites): from C in one call (graph_runner.c) where
    the calls fit its records, else from Python one call at a time."""

    def __init__(self, calls: list[tuple], output: torch.Tensor, buffers: list[torch.Tensor]):
        self.calls = tuple(calls)  # (function, args, status)
        self.output = output
        self.buffers = buffers  # what the moved pointers point into: kept alive here
        self.num_bytes = sum(b.numel() for b in buffers)
        self.kernels = frozenset(fn.__name__ for fn, _, _ in calls)
        self.run_calls = _runner()
        self.records = None if self.run_calls is None else _records(calls)

    def replay(self) -> torch.Tensor:
        if self.records is not None:
            failed = self.run_calls(ctypes.addressof(self.records), len(self.calls))
            if failed >= 0:
                self._failed(self.calls[failed][0])
            return self.output
        for fn, args, status in self.calls:
            if fn(*args) != status:
                self._failed(fn)
        return self.output

    @staticmethod
    def _failed(fn) -> None:
        raise ReplayError(f"{fn.__name__} returned another status than at capture")


def capture(
    region: Callable[[], torch.Tensor],
    inputs: Sequence[torch.Tensor],
    constants: Sequence[torch.Tensor] = (),
    check: bool | Callable[[frozenset[str]], bool] = True,
) -> CallGraph:
    """Runs `region` once and returns its graph, checked by a replay from the same inputs
    where `check` says so (a bool, or a function of the names of the kernels the graph calls).
    inputs: every tensor the region reads that a caller refills (saved and restored around
    the check: the region may change them in place); constants: inputs whose data the region
    may read into Python (they must hold the same values at every replay). The graph's output
    holds the region's (a view of its buffers)."""
    saved = [t.clone() for t in inputs]
    checked = check if callable(check) else lambda names: check
    for _ in range(2):  # again where a kernel library loaded during the run: its calls passed
        num_libraries = len(loaded_libraries())
        watch = _Watch(constants)
        with _Recorder() as recorder, watch:
            expected = region()
        if len(loaded_libraries()) == num_libraries:
            break
        _restore(inputs, saved)
    else:
        raise CaptureError("kernel libraries were still loading")
    if not recorder.calls:
        raise CaptureError("made no kernel calls")
    graph = _relocate(recorder.calls, watch.made, expected)
    if checked(graph.kernels):
        _restore(inputs, saved)
        if not torch.equal(graph.replay(), expected):
            raise CaptureError("the replay's output differs from the capture's")
    else:
        graph.output.copy_(expected)
    return graph


def _restore(inputs: Sequence[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for t, value in zip(inputs, saved):
        t.copy_(value)


def _relocate(calls: list[tuple], made: list[torch.Tensor], output: torch.Tensor) -> CallGraph:
    """The calls with each pointer into a tensor the region made moved into a shared buffer."""
    spans = sorted({_storage(t) for t in made})
    starts = [start for start, _ in spans]
    uses: list[list[tuple[int, int, int]]] = []  # per call: (arg index, span index, offset)
    first, last = {}, {}
    for idx, (fn, args, _) in enumerate(calls):
        found = []
        for arg_idx, (arg, kind) in enumerate(zip(args, fn.argtypes)):
            span_idx = _span_of(arg, kind, spans, starts)
            if span_idx is not None:
                found.append((arg_idx, span_idx, arg - spans[span_idx][0]))
                first.setdefault(span_idx, idx)
                last[span_idx] = idx
        uses.append(found)
    out_span = _span_of(output.data_ptr(), PTR, spans, starts)
    if out_span is not None:
        last[out_span] = len(calls)  # the output outlives every call
    buffers = _assign(first, last, spans, len(calls))
    moved = []
    for (fn, args, status), found in zip(calls, uses):
        args = list(args)
        for arg_idx, span_idx, offset in found:
            args[arg_idx] = buffers[span_idx].data_ptr() + offset
        moved.append((fn, tuple(args), status))
    if out_span is not None:
        output = _view_at(buffers[out_span], output)
    return CallGraph(moved, output, list({id(b): b for b in buffers.values()}.values()))


def _span_of(arg, kind, spans, starts) -> int | None:
    if kind is not PTR or not isinstance(arg, int):
        return None
    idx = bisect.bisect_right(starts, arg) - 1
    if idx < 0 or arg >= spans[idx][0] + spans[idx][1]:
        return None
    return idx


def _assign(first: dict, last: dict, spans: list, num_calls: int) -> dict[int, torch.Tensor]:
    """A buffer for each span, reused after its last call by a later span of the same size."""
    starting: dict[int, list[int]] = {}
    for span_idx, idx in first.items():
        starting.setdefault(idx, []).append(span_idx)
    ending: dict[int, list[int]] = {}
    for span_idx, idx in last.items():
        ending.setdefault(idx, []).append(span_idx)
    free: dict[int, list[torch.Tensor]] = {}
    buffers = {}
    for idx in range(num_calls + 1):
        for span_idx in starting.get(idx, ()):
            size = spans[span_idx][1]
            pool = free.get(size)
            buffers[span_idx] = pool.pop() if pool else torch.empty(size, dtype=torch.uint8)
        for span_idx in ending.get(idx, ()):
            free.setdefault(spans[span_idx][1], []).append(buffers[span_idx])
    return buffers


def _view_at(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`like` over `buffer`, which stands in for its whole storage: same dtype, shape,
    strides and offset."""
    return buffer.view(like.dtype).as_strided(like.shape, like.stride(), like.storage_offset())
