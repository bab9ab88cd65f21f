"""An LLM dropped without close(): its threads end, and the garbage collector, which may run
on any thread (even one inside threading's own locks, where a join deadlocks), joins none of
them there. A CI run hung so: a disk reader thread's start collected an older LLM whose
finalizer joined its step thread while the new thread held the lock that join needs. And an
LLM still alive at interpreter exit closes before the interpreter ends, not on a daemon thread
mid-close ("terminate called without an active exception", exit 134). The checks run in a
child process: a deadlock there fails this test instead of hanging the suite."""

import subprocess
import sys

import pytest

CHILD = r"""
import gc, os, sys, threading
from kvpager.engine import LLM

def make():
    llm = LLM(sys.argv[1], dtype="float32", block_size=16, num_blocks=16)
    assert llm.generate([[5, 6, 7]], dict(temperature=0.0, max_tokens=2), use_tqdm=False)
    llm.check_invariants()  # every block accounted for before it is dropped
    return llm

llm = make()
threads = [*llm.runner._worker._threads, llm._loop._thread]
assert all(thread.is_alive() for thread in threads)
llm.cycle = llm  # only the cyclic collector frees it
del llm
gc.set_threshold(0)  # no automatic collection: the one below frees it (collector on)

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
    os._exit(3)
gc.set_threshold(700)
if sys.argv[2] == "exit-at-once":  # its close may still run: the exit waits for it
    print("ok", flush=True)
    sys.exit(0)
for thread in threads:
    thread.join(20.0)
    if thread.is_alive():
        print(f"{thread.name} outlived its LLM", flush=True)
        os._exit(4)
print("ok", flush=True)
"""


@pytest.mark.parametrize("then", ["join-its-threads", "exit-at-once"])
def test_a_dropped_llm_ends_its_threads_without_a_deadlock_or_an_abort(tiny_llama, tmp_path, then):
    child = subprocess.run(  # not from the repository root, whose folders shadow packages
        [sys.executable, "-c", CHILD, str(tiny_llama), then],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = child.stdout[-2000:] + child.stderr[-2000:]
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), output
    assert "terminate called" not in child.stderr, output
