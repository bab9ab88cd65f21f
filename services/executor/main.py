"""Entry point of `kvpager executor`: load the model and cache first, then attach."""

from services.executor.service import ExecutorService, load_executor
from services.runtime import run_service, setup_logging
from services.settings import Settings


def run(settings: Settings) -> int:
    setup_logging(settings, "executor")
    executor = load_executor(settings)
    return run_service("executor", settings, lambda nc: ExecutorService(nc, settings, executor))
