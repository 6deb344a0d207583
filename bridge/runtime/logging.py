"""structlog set-up, done once by the process entry point."""

from __future__ import annotations

import logging
import sys

import structlog


class StderrLogger:
    """Writes each line to the `sys.stderr` of the moment, not the one at
    set-up: a caller that swaps it (a test runner capturing output, then
    closing its capture) leaves no logger writing to a closed file."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


def stderr_logger(*_args: object) -> StderrLogger:
    """structlog's logger factory for StderrLogger."""
    return StderrLogger()


def configure_logging(fmt: str, level: str) -> None:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
