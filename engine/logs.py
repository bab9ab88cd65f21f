"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is."""

import logging
import sys

import structlog


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog once for the process; `json=None` picks by whether stderr is a tty."""
    json = not sys.stderr.isatty() if json is None else json
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def ensure_logging() -> None:
    """Library entry points call this: a default set-up unless the application made its own."""
    if not structlog.is_configured():
        configure_logging("warning")
