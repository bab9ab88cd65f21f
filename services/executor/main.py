"""Entry point of `kvpager executor`: load the model and cache first, then attach.

With `--tensor-parallel-size N` it is rank 0 and starts ranks 1..N-1 itself; started by torchrun
(RANK, WORLD_SIZE set), rank 0 serves and every other rank runs the rank loop.
"""

from kvpager.engine.memory import resolve_device
from kvpager.engine.worker.step_runner import InProcessExecutor
from kvpager.engine.worker.tensor_parallel import run_rank, torchrun_rank
from kvpager.services.executor.service import ExecutorService, load_executor
from kvpager.services.runtime import run_service, setup_logging
from kvpager.services.settings import Settings


def run(settings: Settings) -> int:
    setup_logging(settings, "executor")
    joined = torchrun_rank()
    if joined is not None and joined[0] != 0:  # torchrun: this process is a rank, not the service
        return run_rank(*joined)
    # loaded on the thread that runs every step, as the offline LLM's is
    runner = InProcessExecutor(lambda: load_executor(settings), resolve_device(settings.device))
    return run_service("executor", settings, lambda nc: ExecutorService(nc, settings, runner))
