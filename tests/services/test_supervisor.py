"""serve's supervisor on real child processes: restarts with backoff, gives up on a loop,
blames the request a child was admitting when it died, and refuses one that did so twice."""

import signal
import subprocess
import sys

import pytest
from kvpager.schemas.errors import PoisonedRequestError
from kvpager.services.inflight import Journal
from kvpager.services.serve.supervisor import MAX_CRASHES, Child, CrashLoopError, Supervisor


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


def crashing_while(journal_dir, admitting: str | None, stream: str | None = None):
    """A real child that journals what it does, then dies of SIGSEGV in the middle of it:
    admitting the request keyed `admitting` (None: between requests), owning `stream`."""
    code = [
        "import os, signal",
        "from services.inflight import Journal",
        f"journal = Journal({str(journal_dir)!r})",
        "with journal.admitting('done-before'):",  # a finished admission blames nothing
        "    pass",
    ]
    if stream is not None:
        code.append(f"journal.stream_opened({stream!r}, '_INBOX.x.{stream}', False)")
    if admitting is not None:
        code.append(f"held = journal.admitting({admitting!r}); held.__enter__()")
    code.append("os.kill(os.getpid(), signal.SIGSEGV)")
    argv = [sys.executable, "-c", "\n".join(code)]
    return lambda: subprocess.Popen(argv)


def _crash_once(supervisor: Supervisor, child: Child, now: float) -> float:
    """Let the child die, have the supervisor notice and restart it; the backoff it chose."""
    first = child.process
    assert first.wait(timeout=30) == -signal.SIGSEGV
    supervisor.check(now)
    backoff = child.restart_at - now
    supervisor.check(now + backoff)
    assert child.process is not first
    return backoff


def test_a_crash_while_admitting_blames_the_request_not_the_deployment(tmp_path):
    """Eight crashes in a minute, each with another suspect: none counts, serve keeps going;
    each key has one strike, none is refused yet; the dead child's journal is gone."""
    keys = iter(f"key-{i}" for i in range(100))
    spawn = lambda: crashing_while(tmp_path, next(keys))()  # noqa: E731
    child = Child("tokenizer", spawn, spawn())
    supervisor = Supervisor(None, {"tokenizer": child}, 10.0, tmp_path)
    try:
        backoffs = [_crash_once(supervisor, child, float(i)) for i in range(MAX_CRASHES + 3)]
        assert backoffs == [0.5] * (MAX_CRASHES + 3) and not child.crashes
        assert supervisor.strikes == {f"key-{i}": 1 for i in range(MAX_CRASHES + 3)}
        assert not (tmp_path / "poison").exists()
        live = f"{child.process.pid}.journal"  # the dead ones' journals were read, and removed
        assert {p.name for p in tmp_path.iterdir()} <= {live}
    finally:
        child.process.kill()
        child.process.wait()


def test_a_request_that_crashes_twice_is_refused(tmp_path):
    spawn = crashing_while(tmp_path, "deadly")
    child = Child("gateway", spawn, spawn())
    supervisor = Supervisor(None, {"gateway": child}, 10.0, tmp_path)
    front_door = Journal(tmp_path)  # another process's view of the poison list
    try:
        _crash_once(supervisor, child, 0.0)
        with front_door.admitting("deadly"):  # one strike: still admitted
            pass
        _crash_once(supervisor, child, 1.0)
        assert (tmp_path / "poison").read_text() == "deadly\n"
        with pytest.raises(PoisonedRequestError, match="crashed a kvpager service twice"):
            with front_door.admitting("deadly"):
                raise AssertionError("admitted")
        with front_door.admitting("harmless"):
            pass
        assert not child.crashes
    finally:
        child.process.kill()
        child.process.wait()


def test_crashes_without_a_suspect_still_give_up_and_orphan_their_streams(tmp_path):
    streams = iter(f"stream-{i}" for i in range(100))
    spawn = lambda: crashing_while(tmp_path, None, next(streams))()  # noqa: E731
    child = Child("tokenizer", spawn, spawn())
    supervisor = Supervisor(None, {"tokenizer": child}, 10.0, tmp_path)
    try:
        with pytest.raises(CrashLoopError, match="the tokenizer exited with code -11, its 5th"):
            for i in range(MAX_CRASHES):
                _crash_once(supervisor, child, float(i))
        assert not supervisor.strikes
        assert supervisor.orphans == {
            f"stream-{i}": (f"_INBOX.x.stream-{i}", False) for i in range(MAX_CRASHES)
        }
    finally:
        child.process.kill()
        child.process.wait()
