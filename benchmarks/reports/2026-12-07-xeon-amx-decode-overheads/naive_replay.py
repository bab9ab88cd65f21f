"""A naive replay of one decode step's kernel calls: every ctypes call of one Decoder.forward
recorded with its arguments, every tensor the forward made kept alive (a TorchFunctionMode
holds them), then the same calls made again in a bare Python loop, the residual stream
restored before each replay (the norms add into it in place); best of 15, beside the forward's
median, and each kernel's mean time over three replays.

It does not measure what a replay with fixed, reused buffers would: here each layer's
intermediates sit at their own addresses, where the engine's allocator hands the same few
buffers to every layer, so the replayed kernels meet colder outputs.

    PYTHONPATH=. python benchmarks/reports/2026-12-07-xeon-amx-decode-overheads/naive_replay.py \
        bfloat16 64 300
"""

import ctypes
import time

from decode_setup import decoding_setup, wrap_kernels
from kvpager.engine import SamplingParams
from torch.overrides import TorchFunctionMode


class KeepAlive(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kept.append(out)
        return out


def main() -> None:
    dtype, rows, llm, prompts = decoding_setup()
    recording: list | None = None

    def recorded_call(fn):
        def call(*args):
            if recording is not None:
                recording.append((fn, args))
            return fn(*args)

        return call

    wrap_kernels(recorded_call)
    model, forward = llm.executor.model, llm.executor.model.forward
    forward_s, calls, keep = [], [], KeepAlive()

    def timed_forward(input_ids, *args, **kwargs):
        nonlocal recording
        decode = input_ids.shape[0] == rows
        if decode and len(forward_s) == 10 and not calls:
            recording = calls
            with keep:
                out = forward(input_ids, *args, **kwargs)
            recording = None
            return out
        start = time.perf_counter()
        out = forward(input_ids, *args, **kwargs)
        if decode:
            forward_s.append(time.perf_counter() - start)
        return out

    model.forward = timed_forward
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    norm = next(args for fn, args in calls if fn.__name__.startswith("add_rms_norm"))
    nbytes = norm[4] * norm[5] * (2 if dtype == "bfloat16" else 4)  # the residual [T, hidden]
    state = ctypes.create_string_buffer(nbytes)
    ctypes.memmove(state, norm[0], nbytes)
    best, per_kernel = float("inf"), {}
    for round_ in range(18):
        ctypes.memmove(norm[0], state, nbytes)
        start = time.perf_counter()
        for fn, args in calls:
            if round_ < 15:
                fn(*args)
                continue
            began = time.perf_counter()
            fn(*args)
            per_kernel[fn.__name__] = per_kernel.get(fn.__name__, 0.0) + time.perf_counter() - began
        if round_ < 15:
            best = min(best, time.perf_counter() - start)
    median = sorted(forward_s)[len(forward_s) // 2] * 1e3
    print(f"{dtype}, {rows} rows x {len(prompts[0])} tokens: Decoder.forward median "
          f"{median:.1f} ms; its {len(calls)} C calls replayed {best * 1e3:.1f} ms")  # fmt: skip
    print("  " + ", ".join(f"{k} {v / 3 * 1e3:.2f}" for k, v in per_kernel.items()) + " (ms)")
    llm.close()


if __name__ == "__main__":
    main()
