"""serve's supervisor on real child processes: restarts with backoff, gives up on a loop."""

import subprocess
import sys

import pytest

from services.serve.supervisor import Child, CrashLoopError, Supervisor


def crashing() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def sleeping() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_an_exited_child_restarts_after_a_growing_backoff_then_serve_gives_up():
    children = {
        "executor": Child("executor", crashing, crashing()),
        "tokenizer": Child("tokenizer", sleeping, sleeping()),
    }
    tokenizer = children["tokenizer"].process
    supervisor = Supervisor(None, children, liveness_timeout_s=10.0)
    try:
        now, restarts = 0.0, []
        with pytest.raises(CrashLoopError, match="the executor exited with code 3, its 5th"):
            for _ in range(5):
                first = children["executor"].process
                first.wait()
                supervisor.check(now)  # noticed: a restart is due after the backoff
                restarts.append(children["executor"].restart_at - now)
                supervisor.check(now + restarts[-1])
                assert children["executor"].process is not first  # started again
                now += restarts[-1]
        assert restarts == [0.5, 1.0, 2.0, 4.0]
        assert children["tokenizer"].process is tokenizer and tokenizer.poll() is None
    finally:
        for child in children.values():
            child.process.kill()
            child.process.wait()


def test_a_child_that_stops_answering_is_killed_and_restarted():
    """Its pid answered $SRV.PING once, then not for longer than the liveness timeout."""
    children = {"executor": Child("executor", sleeping, sleeping())}
    hung = children["executor"].process
    supervisor = Supervisor(None, children, liveness_timeout_s=3.0)
    try:
        supervisor.check(0.0, {hung.pid})
        supervisor.check(2.0)  # silent, but within the timeout
        assert hung.poll() is None
        supervisor.check(3.5)  # past it: killed, a restart due after the backoff
        assert hung.poll() is not None and children["executor"].restart_at == 4.0
        supervisor.check(4.0)
        assert children["executor"].process is not hung
    finally:
        children["executor"].process.kill()
        children["executor"].process.wait()
