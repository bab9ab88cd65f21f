"""kernels/openmp.py: a thread that called `serial_here` runs torch ops on itself alone, where
a thread left as it is starts an OpenMP team of its own (whose pool would slow every
barrier of the step thread's team for as long as the thread lives)."""

import os
import threading

import pytest
import torch
from kvpager.kernels import openmp

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or openmp._omp_set_num_threads() is None,
    reason="needs Linux's /proc and torch on libgomp",
)


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _copy_on_a_new_thread(prepare) -> tuple[int, int]:
    """(torch's thread count there, OS threads a large copy there added)."""
    source = torch.arange(1 << 21, dtype=torch.float32)  # far above torch's grain size
    result = {}

    def body() -> None:
        prepare()
        before = _os_threads()
        torch.empty_like(source).copy_(source)
        # threads started, not the count's change: another test's threads may end meanwhile
        result["counts"] = torch.get_num_threads(), len(_os_threads() - before)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return result["counts"]


def test_a_serial_thread_starts_no_team_where_a_plain_one_does():
    threads = torch.get_num_threads()

    def two_threads() -> None:  # a plain thread, given two whatever this host's default
        torch.get_num_threads()
        openmp._omp_set_num_threads()(2)

    assert _copy_on_a_new_thread(two_threads) == (2, 1)  # its team's one worker
    assert _copy_on_a_new_thread(openmp.serial_here) == (1, 0)
    assert torch.get_num_threads() == threads  # the calling thread keeps its own


def test_the_engines_side_threads_are_serial():
    from kvpager.engine.frontend.event_loop import LoopThread

    loop = LoopThread()

    async def count() -> int:
        return torch.get_num_threads()

    try:
        assert loop.run(count()) == 1
    finally:
        loop.close()


def test_a_serial_pools_threads_are_serial():
    pool = openmp.serial_pool(2, "test-serial")
    try:
        assert {pool.submit(torch.get_num_threads).result() for _ in range(4)} == {1}
    finally:
        pool.shutdown()
