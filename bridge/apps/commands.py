"""The consumers' subcommands of `kv-bridge` (and `nats-permissions`); each module adds its own parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

REGISTRARS: list[Registrar] = []

from bridge.apps import fleet, permissions, tail, watch  # noqa: E402  (tool modules come after REGISTRARS exists)

REGISTRARS.append(tail.register)
REGISTRARS.append(watch.register)
REGISTRARS.append(fleet.register)
REGISTRARS.append(permissions.register)
