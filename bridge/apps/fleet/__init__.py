"""`kv-bridge observe`: a long-running consumer service. It follows
`<prefix>.>` and the worker registry, keeps the residency index, and serves
the cluster's state on /metrics, the router-facing API (GET /v1/workers,
POST /v1/prefix) over HTTP and as a NATS micro service, the Mooncake
Conductor indexer API (POST /query, /query_by_hash), /healthz and /readyz.
docs/observe.md has the API and the metrics."""

from __future__ import annotations

import argparse
import sys

import anyio

from bridge.apps.fleet.options import ObserveOptions, add_observe_arguments
from bridge.apps.fleet.service import ObserveService
from bridge.client.connection import access_settings, add_access_arguments
from bridge.runtime.access import ConfigError
from bridge.runtime.stopping import until_signal

__all__ = ["ObserveOptions", "ObserveService", "register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "observe", help="Consumer service: cluster residency on /metrics, prefix queries over HTTP and NATS.",
        description="Follows the bus and the worker registry, keeps the residency index and serves /metrics "
                    "(resident blocks by worker, group, family and medium; rates; duplication; hybrid effect; "
                    "gaps, lag, staleness), GET /v1/workers, POST /v1/prefix, the same query as a NATS micro "
                    "service, the indexer API (POST /query, /query_by_hash), /healthz and /readyz. "
                    "SIGTERM or Ctrl-C stops it.",
    )
    add_observe_arguments(parser)
    add_access_arguments(parser)
    parser.set_defaults(func=_cmd_observe)


def _configure_logging() -> None:
    import logging

    import structlog

    from bridge.runtime.logging import stderr_logger

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=stderr_logger,
    )


def _cmd_observe(args: argparse.Namespace) -> int:
    try:
        settings = access_settings(args)
        opts = ObserveOptions(args)
    except (ConfigError, ValueError) as exc:
        print(f"kv-bridge observe: {exc}", file=sys.stderr)
        return 2
    _configure_logging()
    try:
        service = ObserveService(opts)
        return anyio.run(until_signal, lambda: service.run(settings))
    except KeyboardInterrupt:  # Ctrl-C before the loop runs
        return 0
