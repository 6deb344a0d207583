"""The nats-py release whose private internals kv-bridge reads, and the one
installed. Two adapters read internals: the sink's fast path
(`bridge.producer.sink.nats_fastpath`) and the inbox-only services
(`bridge.runtime.inbox_service`); each checks this pin and the names it uses
before it relies on them, and falls back when they do not hold.
requirements/ci.txt and the image install this release."""

from __future__ import annotations

import importlib.metadata
from typing import Final

PINNED_NATS_PY: Final = "2.16.0"


def installed_nats_py() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
