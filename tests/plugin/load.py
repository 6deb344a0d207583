"""Load the plugin the way vLLM's loader may (twice), on whichever vLLM this process imports.

`python -m tests.plugin.load OUT.json` writes the vLLM version, the tracker's
methods before and after, and every line the plugin logged; then the same
again as a fresh process would see it with the version check waived
(KVB_PLUGIN_ALLOW_UNVERIFIED_VLLM=1), so one process shows both of the
plugin's refusals. It needs nothing of vLLM but the tracker's module, so it
also runs on releases the plugin refuses, where `scenario.py`'s harness
cannot be built.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events as vllm_events

import bridge.plugin as plugin
from bridge.plugin import compat
from bridge.plugin.log import LOGGER_NAME

TRACKER_METHODS = (
    "record_store",
    "record_lookup",
    "record_partial_store",
    "record_partial_lookup",
    "take_events",
    "reset",
)


def method_ids() -> dict[str, int | None]:
    """Identity of each tracker method in the class body (None where it has none)."""
    cls = vllm_events.OffloadingEventsTracker
    return {name: id(cls.__dict__[name]) if name in cls.__dict__ else None for name in TRACKER_METHODS}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append({"level": record.levelname, "message": record.getMessage()})


def register_twice() -> list[dict[str, str]]:
    """Call register() twice; every line the plugin logged, DEBUG included."""
    records = _Records()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        plugin.register()
        plugin.register()
    finally:
        logger.removeHandler(records)
    return records.lines


def _load(result: dict[str, object], suffix: str) -> None:
    result["methods_before" + suffix] = method_ids()
    result["log" + suffix] = register_twice()
    result["methods_after" + suffix] = method_ids()


def main(argv: Sequence[str] | None = None) -> int:
    (out,) = argv if argv is not None else sys.argv[1:]
    result: dict[str, object] = {"vllm_version": compat.vllm_version()}
    _load(result, "")
    os.environ[compat.ALLOW_UNVERIFIED_ENV] = "1"
    plugin._unsupported_warned = False  # what a new process starts with
    _load(result, "_allowed")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
