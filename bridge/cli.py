"""`kv-bridge`: run the bridge, run the demo, and the consumers' tools."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from bridge import __version__

if TYPE_CHECKING:
    from bridge.producer.config import Settings

# The commands' modules (NATS, anyio, msgspec, rich, ...) are imported only
# inside main(), after a signal already means "stop": a Ctrl-C or SIGTERM
# while they load ends the process quietly with status 0, as it would a
# moment later, once the command takes signals itself.


def _settings(args: argparse.Namespace) -> Settings:
    from bridge.producer.config import ConfigError, load_settings

    try:
        return load_settings(args, os.environ)
    except ConfigError as exc:
        print(f"kv-bridge: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _cmd_run(args: argparse.Namespace) -> int:
    from bridge.producer.service import run_bridge
    from bridge.runtime.logging import configure_logging

    settings = _settings(args)
    configure_logging(settings.log_format, settings.log_level)
    return run_bridge(settings)


def _cmd_demo(args: argparse.Namespace) -> int:
    import anyio

    from bridge.apps.demo.run import run_demo
    from bridge.runtime.logging import configure_logging

    settings = _settings(args)
    configure_logging(settings.log_format if args.log_format else "console", settings.log_level if args.log_level else "warning")
    if args.workers < 1:
        print("kv-bridge demo: --workers must be at least 1", file=sys.stderr)
        return 2
    return anyio.run(run_demo, settings, args.batches, args.interval, args.events_per_batch, sys.stdout,
                     args.workers, args.quiet)


def build_parser() -> argparse.ArgumentParser:
    from bridge.producer.config import add_run_arguments

    parser = argparse.ArgumentParser(prog="kv-bridge", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"kv-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Bridge vLLM's ZMQ KV events to NATS.", allow_abbrev=False)
    add_run_arguments(run)
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser(
        "demo", allow_abbrev=False,
        help="Whole flow on this machine: vLLM-format publisher → bridge → NATS → printer.",
    )
    add_run_arguments(demo)
    demo.add_argument("--batches", type=int, default=200, help="Batches the demo publisher sends.")
    demo.add_argument("--interval", type=float, default=0.05, help="Seconds between batches.")
    demo.add_argument("--events-per-batch", type=int, default=6, help="Events per batch.")
    demo.add_argument("--workers", type=int, default=1,
                      help="Simulated hybrid workers, each with its own bridge, into one nats-server.")
    demo.add_argument("--quiet", action="store_true", help="No line per message; print each bridge's /metrics URL.")
    demo.set_defaults(func=_cmd_demo)

    for register in _tool_registrars():
        register(sub)
    return parser


def _tool_registrars() -> list:
    """Consumers' subcommands (tail, watch, ...) register themselves here."""
    from bridge.apps import commands

    return commands.REGISTRARS


def _stop_quietly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


@contextmanager
def _quiet_signals() -> Iterator[None]:
    """Until a command takes SIGINT, SIGTERM and SIGHUP itself (anyio's
    signal receivers, `bridge.runtime.stopping`), they end the process with
    status 0; the previous handlers come back after, for a caller that runs
    main() in its own process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from bridge.runtime.signals import stop_signals

    previous = {sig: signal.signal(sig, _stop_quietly) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    with _quiet_signals():
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
