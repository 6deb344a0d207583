"""The library's loggers: structlog key-value lines on stderr.

Library code never writes stdout (a tool's output goes there: `tail --json`,
`watch`'s table). An application that configures structlog gets the library's
lines through its own configuration; one that does not gets them on stderr,
rendered by structlog's default processors, without this module touching
structlog's global configuration (which belongs to the process entry point).
"""

from __future__ import annotations

import sys
from typing import Any

import structlog


class LibraryLogger:
    """`structlog.get_logger(name)` when the application configured structlog,
    else a logger with structlog's default processors printing to stderr.
    Decided at each call, so configuring later (or a test capturing stderr)
    takes effect."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self.name)
        return structlog.wrap_logger(structlog.PrintLogger(sys.stderr))

    def debug(self, event: str, **kw: Any) -> None:
        self._target().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._target().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._target().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._target().error(event, **kw)


def get_logger(name: str) -> LibraryLogger:
    return LibraryLogger(name)
