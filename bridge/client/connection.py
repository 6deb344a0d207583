"""How consumers reach NATS: the bridge's own flags and `KVB_*` variables for
servers, auth and TLS, so one set of credentials and one habit serve both.

Secrets come from files or the environment only (as for `kv-bridge run`), and
the tools read only the access variables, so an unrelated `KVB_*` setting meant
for a bridge on the same host cannot break them.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Mapping
from typing import Final

import anyio
import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from bridge.runtime.access import ACCESS_OPTIONS, ConfigError, NatsAccess, connect_options, load_access

DEFAULT_URL: Final = "nats://127.0.0.1:4222"

_ACCESS_DESTS: Final = frozenset(o.dest for o in ACCESS_OPTIONS)


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """`--nats-url`, `--subject-prefix` and the auth/TLS file flags, as `run` has them."""
    group = parser.add_argument_group("NATS access (same flags and KVB_* variables as `kv-bridge run`)")
    for opt in ACCESS_OPTIONS:
        if opt.kind == "secret":
            continue
        help_text = f"{opt.help} [env {opt.env}]"
        if opt.dest == "nats_url":
            help_text = f"NATS server URL (repeatable). Default {DEFAULT_URL}. [env {opt.env}]"
        action = "append" if opt.kind == "list" else "store"
        group.add_argument(opt.flag, dest=opt.dest, action=action, default=None, help=help_text)


def access_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NatsAccess:
    """NATS access (what `connect_options` takes) from the access flags and
    variables only. Raises ConfigError."""
    access = load_access(args, os.environ if environ is None else environ)
    if not access.nats_url:
        access = msgspec.structs.replace(access, nats_url=[DEFAULT_URL])
    return access


def settings_for(*urls: str, environ: Mapping[str, str] | None = None, **options: str) -> NatsAccess:
    """Settings for API users: server URLs plus any access option by its
    settings name (`nats_creds_file=...`, `subject_prefix=...`); variables
    (`KVB_NATS_TOKEN`, ...) fill the rest, as for the CLI."""
    unknown = set(options) - _ACCESS_DESTS
    if unknown:
        raise TypeError(f"not NATS access options: {', '.join(sorted(unknown))}")
    return access_settings(argparse.Namespace(nats_url=list(urls) or None, **options), environ)


class BusConnection:
    """One NATS connection plus what a consumer must know about its health:
    a disconnect means core subscribers missed whatever was published meanwhile,
    and a slow-consumer drop means nats-py threw messages away (counted per
    subscription)."""

    def __init__(self) -> None:
        self.nc: NatsClient | None = None
        self.disconnects = 0
        self.slow_consumer_drops: Counter[Subscription] = Counter()
        self._closing = False

    async def _on_disconnect(self) -> None:
        if not self._closing:
            self.disconnects += 1

    async def _on_reconnect(self) -> None:
        return None

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.slow_consumer_drops[exc.sub] += 1

    async def open(self, settings: NatsAccess, name: str, timeout: float = 5.0) -> NatsClient:
        """Connects or raises ConnectionError within `timeout`: nats-py alone
        would retry an unreachable server forever, which a CLI must not."""
        opts = connect_options(settings, name, self._on_disconnect, self._on_reconnect, self._on_error)
        try:
            with anyio.fail_after(timeout):
                self.nc = await nats.connect(**opts)
        except TimeoutError:
            servers = ", ".join(settings.nats_url)
            raise ConnectionError(f"no NATS server answered at {servers} within {timeout:g}s") from None
        return self.nc

    async def close(self) -> None:
        if self.nc is None or self.nc.is_closed:
            return
        self._closing = True
        try:
            await self.nc.drain()
        except Exception:  # closing is best effort: the tool is ending anyway
            await self.nc.close()


__all__ = ["DEFAULT_URL", "BusConnection", "ConfigError", "access_settings", "add_access_arguments", "settings_for"]
