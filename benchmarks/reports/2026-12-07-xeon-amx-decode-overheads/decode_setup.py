"""What the report's step scripts share: SmolLM2-135M built as the benchmarks build it, `rows`
prompts of `context` distinct tokens, prefilled (and their cache blocks reused by the prefix
cache on the measured run), and a timer of calls. The scripts import it from their folder."""

import ctypes
import gc
import sys
import time

import torch
from kvpager.engine import SamplingParams
from kvpager.engine.download import resolve_model

from benchmarks.common.config import BenchConfig
from benchmarks.engine.kvpager_offline import build_llm


def decoding_setup() -> tuple:
    """(dtype, rows, the LLM, its prompts) from argv: DTYPE ROWS CONTEXT."""
    dtype, rows, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    llm = build_llm(BenchConfig(resolve_model("smollm2-135m-instruct"), dtype=dtype))
    prompts = [[(i * 37 + j * 11) % 40000 + 100 for j in range(context)] for i in range(rows)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    return dtype, rows, llm, prompts


def mean_call_s(fn, calls: int) -> float:
    """The mean of `calls` calls of fn, after one to warm it."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def wrap_kernels(wrapper) -> None:
    """Every typed function of every loaded kernel library (kernels/cpu/*.so) replaced by
    wrapper(function): the engine looks them up on the library at each call."""
    for library in [o for o in gc.get_objects() if isinstance(o, ctypes.CDLL)]:
        for name, fn in list(vars(library).items()):
            if isinstance(fn, ctypes._CFuncPtr):
                setattr(library, name, wrapper(fn))
