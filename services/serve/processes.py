"""Child processes of `kvpager serve`: each in its own session, each dying with the launcher.

Own sessions keep a terminal's Ctrl-C away from the children, so the launcher decides the
order of shutdown (services drain first, the nats-server goes last). On Linux a child also
gets SIGTERM if the launcher dies without cleaning up (SIGKILL, a crash).

Children run `python -P -m kvpager.services.cli`: without -P, Python puts the current folder
first on sys.path, and a `resource.py` or a `kvpager/` folder where the user stands would run
inside kvpager's services.
"""

import ctypes
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import IO

PR_SET_PDEATHSIG = 1


def python_module(module: str, *args: str) -> list[str]:
    """argv running `python -m module args` with nothing of the current folder importable."""
    return [sys.executable, "-P", "-m", module, *args]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    argv: Sequence[str], env: dict[str, str] | None = None, output: IO | int | None = None
) -> subprocess.Popen:
    """Start `argv` in a new session; stdout and stderr go to `output` (default: ours)."""
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def terminate(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)


def kill(processes: Sequence[subprocess.Popen]) -> None:
    """SIGKILL what still runs, and reap everything."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def stop(process: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`."""
    terminate([process])
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill([process])
