"""An LLM dropped without close(): the garbage collector ends its threads, and may do so on
any thread, even one inside threading's own locks, where a join would deadlock. A CI run hung
so: a disk reader thread's start collected an older LLM, whose finalizer joined its step
thread while the new thread held the lock that join needs. The check runs in a child process:
a deadlock there must fail this test, not hang the rest of the suite."""

import subprocess
import sys

CHILD = r"""
import gc, sys, threading
from kvpager.engine import LLM

llm = LLM(sys.argv[1], dtype="float32", block_size=16, num_blocks=16)
assert llm.generate([[5, 6, 7]], dict(temperature=0.0, max_tokens=2), use_tqdm=False)
threads = [*llm.runner._worker._threads, llm._loop._thread]
assert all(thread.is_alive() for thread in threads)
llm.cycle = llm  # only the cyclic collector frees it
del llm
gc.disable()  # the collection below is the one that frees it

def collect_inside_threading_locks():
    # where a new thread's start runs (Thread._set_tstate_lock): a finalizer that joins a
    # thread waits there for this very lock
    with threading._shutdown_locks_lock:
        gc.collect()

collector = threading.Thread(target=collect_inside_threading_locks, daemon=True)
collector.start()
collector.join(20.0)
if collector.is_alive():
    print("the LLM's finalizer deadlocked the collecting thread", flush=True)
    import os
    os._exit(3)
for thread in threads:
    thread.join(20.0)
    if thread.is_alive():
        print(f"{thread.name} outlived its LLM", flush=True)
        import os
        os._exit(4)
print("ok", flush=True)
"""


def test_a_dropped_llm_ends_its_threads_without_joining_where_the_collector_runs(
    tiny_llama, tmp_path
):
    child = subprocess.run(  # not from the repository root, whose folders shadow packages
        [sys.executable, "-c", CHILD, str(tiny_llama)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), (
        child.stdout[-2000:] + child.stderr[-2000:]
    )
