"""One OpenMP team in a process: the step thread's.

libgomp spins at a barrier only while the threads it manages, summed over every team in the
process, are no more than the CPUs it may use. Above that, every barrier sleeps in a futex
after ~100 spins (its "throttled" count). A decode step crosses some 300 barriers, so a second
team makes each step sleep and wake at every one of them. The pool of a thread that ran one
parallel region lives as long as that thread, so one torch copy on a side thread (the disk
tier's writer, say) slows every later step: a 4-row bf16 decode step of SmolLM2 took 26-28 ms
instead of 17 on the 2-core AMX host, for the rest of the run.

Threads of ours that may run torch ops beside the steps call `serial_here()` when they start,
or come from a `serial_pool`.
"""

import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor


def serial_here() -> None:
    """Torch ops on the calling thread run on it alone, never in an OpenMP team of its own.
    A process without torch, or whose torch runs another OpenMP runtime, is left as it is."""
    torch = sys.modules.get("torch")
    if torch is None:
        return  # nothing in this process runs OpenMP
    torch.get_num_threads()  # torch sets a thread's count on first use: that comes first
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is not None:
        set_num_threads(1)  # this thread's own setting (OpenMP keeps it per thread)


def serial_pool(max_workers: int | None, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are serial (`serial_here`)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=serial_here)


def _omp_set_num_threads():
    try:  # the libgomp torch loaded, never a second copy
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD on this platform
        return None
    function = library.omp_set_num_threads
    function.restype, function.argtypes = None, [ctypes.c_int]
    return function
