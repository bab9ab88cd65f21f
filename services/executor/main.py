"""Entry point of `kvpager executor`: load the model and cache first, then attach.

With `--tensor-parallel-size N` it is rank 0 and starts ranks 1..N-1 itself; started by torchrun
(RANK, WORLD_SIZE set), rank 0 serves and every other rank runs the rank loop.
"""

import contextvars

from engine.memory import resolve_device
from engine.tensor_parallel import run_rank, torchrun_rank
from services.executor.service import ExecutorService, load_executor, step_thread
from services.runtime import run_service, setup_logging
from services.settings import Settings


def run(settings: Settings) -> int:
    setup_logging(settings, "executor")
    joined = torchrun_rank()
    if joined is not None and joined[0] != 0:  # torchrun: this process is a rank, not the service
        return run_rank(*joined)
    worker = step_thread(resolve_device(settings.device))
    # Load on the thread that will run every step: on CPU, steps on another thread than the one
    # that loaded the model (and packed its weights) ran 20-30% slower (measured, SmolLM2).
    context = contextvars.copy_context()  # log lines from that thread name the service too
    executor = worker.submit(context.run, load_executor, settings).result()
    return run_service(
        "executor", settings, lambda nc: ExecutorService(nc, settings, executor, worker)
    )
