"""Entry point of `kvpager scheduler`."""

from services.runtime import run_service, setup_logging
from services.scheduler.service import SchedulerService
from services.settings import Settings


def run(settings: Settings) -> int:
    setup_logging(settings, "scheduler")
    return run_service("scheduler", settings, lambda nc: SchedulerService(nc, settings))
