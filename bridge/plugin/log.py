"""The plugin's stdlib logger, made visible inside vLLM processes.

vLLM configures only its own "vllm" logger (propagation off) and leaves the
root logger bare, so an INFO record from any other logger reaches no handler
and vanishes. When nothing up our chain would print, the plugin's logger hands
its records to the "vllm" logger, so they come out through whatever handlers,
format and level vLLM is using at that moment (it reconfigures logging when a
process starts). An application that configured logging itself is left alone.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "kv_bridge.plugin"


class _ToVllmLogger(logging.Handler):
    """Re-dispatch records through the "vllm" logger's current handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def get_logger() -> logging.Logger:
    """The "kv_bridge.plugin" logger, routed into vLLM's log if nothing else prints it."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.hasHandlers():
        return logger
    logger.addHandler(_ToVllmLogger())
    # The start-up line is INFO; vLLM's handler level then decides what shows.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
