"""Entry point of `kvpager scheduler`."""

from kvpager.services.runtime import run_service, setup_logging
from kvpager.services.scheduler.service import SchedulerService
from kvpager.services.settings import Settings


def run(settings: Settings) -> int:
    setup_logging(settings, "scheduler")
    return run_service("scheduler", settings, lambda nc: SchedulerService(nc, settings))
