"""serve's supervisor on real child processes: restarts with backoff, gives up on a loop."""

import subprocess
import sys

import pytest

from services.serve.supervisor import CrashLoopError, Supervisor


def crashing() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def sleeping() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_an_exited_child_restarts_after_a_growing_backoff_then_serve_gives_up():
    children = {"executor": crashing(), "tokenizer": sleeping()}
    tokenizer = children["tokenizer"]
    supervisor = Supervisor(children, {"executor": crashing, "tokenizer": sleeping})
    try:
        now, restarts = 0.0, []
        with pytest.raises(CrashLoopError, match="the executor exited 5 times"):
            for _ in range(5):
                first = children["executor"]
                first.wait()
                supervisor.check(now)  # noticed: a restart is due after the backoff
                restarts.append(supervisor._state["executor"].restart_at - now)
                supervisor.check(now + restarts[-1])
                assert children["executor"] is not first  # started again
                now += restarts[-1]
        assert restarts == [0.5, 1.0, 2.0, 4.0]
        assert children["tokenizer"] is tokenizer and tokenizer.poll() is None  # untouched
    finally:
        for process in children.values():
            process.kill()
            process.wait()
