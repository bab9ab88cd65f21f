"""Start ranks 1..N-1 of a group on this machine, as torchrun would: one process each, the
standard `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` variables set.

Each child gets SIGTERM when its parent dies (Linux), so a crashed rank 0 leaves no rank
behind; a rank 0 that exits cleanly tells them first (`RankShutdown`).
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from kvpager.schemas.errors import ConfigError

PR_SET_PDEATHSIG = 1
WORKER_MODULE = "kvpager.engine.worker.tensor_parallel"
ROOT = Path(__file__).resolve().parents[2]  # the folder `engine` is in: the ranks import it


def check_devices(device: torch.device, world_size: int) -> None:
    """One rank per device: on CUDA, `world_size` must not exceed the devices there are."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count()
    if world_size > count:
        raise ConfigError(
            f"tensor_parallel_size: {world_size} ranks need {world_size} CUDA devices, "
            f"{count} found"
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_per_rank(device: torch.device, world_size: int) -> int:
    """On CPU the ranks share this process's threads (they share its cores)."""
    return max(1, torch.get_num_threads() // world_size) if device.type == "cpu" else 1


def spawn_ranks(world_size: int, port: int, num_threads: int) -> list[subprocess.Popen]:
    """Ranks 1..world_size-1 of a group whose rank 0 (the caller) listens on `port`."""
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(num_threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        for rank in range(1, world_size)
    ]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
