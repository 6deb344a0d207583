"""`kv-bridge observe`'s flags."""

from __future__ import annotations

import argparse

from bridge.client.bootstrap import BootstrapOptions, add_bootstrap_arguments, bootstrap_options
from bridge.client.registry import DEFAULT_BUCKET, DEFAULT_DEAD_AFTER
from bridge.client.subscribe import DEFAULT_STREAM, StartAt, parse_since

DEFAULT_PORT = 9410
DEFAULT_SERVICE_SUBJECT = "kvobserve"
DEFAULT_EXPIRE_AFTER = 3600.0
DEFAULT_QUERY_CONCURRENCY = 1


class ObserveOptions:
    def __init__(self, args: argparse.Namespace | None = None, **overrides: object) -> None:
        self.http_host: str = "0.0.0.0"
        self.http_port: int = DEFAULT_PORT
        self.bucket: str = DEFAULT_BUCKET
        self.dead_after: float = DEFAULT_DEAD_AFTER
        self.since: StartAt | None = None
        self.stream: str = DEFAULT_STREAM
        self.serve_nats: bool = True
        self.service_subject: str = DEFAULT_SERVICE_SUBJECT
        self.queue_group: str = "kvobserve"
        self.max_worker_series: int = 1000
        self.hybrid_interval: float = 15.0
        self.hybrid_sample: int = 4096
        self.connect_timeout: float = 10.0
        self.expire_after: float = DEFAULT_EXPIRE_AFTER
        self.query_concurrency: int = DEFAULT_QUERY_CONCURRENCY
        # Bootstrap from the bridges' snapshots (core NATS), or `--since snapshot`.
        self.bootstrap: BootstrapOptions | None = BootstrapOptions()
        if args is not None:
            self.http_host = args.http_host
            self.http_port = args.http_port
            self.bucket = args.registry_bucket
            self.dead_after = args.dead_after
            self.since = parse_since(args.since) if args.since else None
            self.stream = args.stream_name
            self.serve_nats = not args.no_nats_service
            self.service_subject = args.service_subject
            self.queue_group = args.queue_group
            self.max_worker_series = args.max_worker_series
            self.hybrid_interval = args.hybrid_interval
            self.hybrid_sample = args.hybrid_sample
            self.expire_after = args.expire_after
            self.query_concurrency = args.query_concurrency
            self.bootstrap = bootstrap_options(args, getattr(args, "subject_prefix", None) or "kv")
        for key, value in overrides.items():
            if not hasattr(self, key):
                raise TypeError(f"unknown option {key}")
            setattr(self, key, value)
        if self.max_worker_series < 1 or self.hybrid_sample < 1 or self.hybrid_interval <= 0:
            raise ValueError("--max-worker-series, --hybrid-sample and --hybrid-interval must be positive")
        if self.expire_after <= 0 or self.query_concurrency < 1:
            raise ValueError("--expire-after and --query-concurrency must be positive")


def add_observe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-host", default="0.0.0.0", help="Address of the HTTP server.")
    parser.add_argument("--http-port", type=int, default=DEFAULT_PORT,
                        help=f"Port of /metrics, /healthz, /readyz and /v1/* (default {DEFAULT_PORT}; 0: any).")
    parser.add_argument("--registry-bucket", default=DEFAULT_BUCKET,
                        help="Worker registry KV bucket for liveness ('' to ignore the registry).")
    parser.add_argument("--dead-after", type=float, default=DEFAULT_DEAD_AFTER,
                        help="A worker is dead after this many heartbeat intervals without one.")
    parser.add_argument("--since", default=None,
                        help="Rebuild the index from the JetStream stream first: 'snapshot' (each rank's snapshot, "
                             "then the stream after it), 'all', a sequence, or an age like 10m.")
    parser.add_argument("--stream-name", default=DEFAULT_STREAM, help="JetStream stream for --since.")
    parser.add_argument("--no-nats-service", action="store_true",
                        help="Do not answer prefix queries over NATS (the micro service).")
    parser.add_argument("--service-subject", default=DEFAULT_SERVICE_SUBJECT,
                        help="Subjects of the NATS service: <this>.prefix and <this>.workers.")
    parser.add_argument("--queue-group", default="kvobserve",
                        help="Queue group of the NATS service (replicas share the queries).")
    parser.add_argument("--max-worker-series", type=int, default=1000,
                        help="Worker ranks listed in per-worker metric families (the cardinality bound).")
    parser.add_argument("--hybrid-interval", type=float, default=15.0,
                        help="Seconds between refreshes of the hybrid-effect figures.")
    parser.add_argument("--expire-after", type=float, default=DEFAULT_EXPIRE_AFTER,
                        help="Seconds after which a worker whose ranks are all stopped or dead is forgotten "
                             f"(answers and metrics; default {DEFAULT_EXPIRE_AFTER:g}).")
    parser.add_argument("--query-concurrency", type=int, default=DEFAULT_QUERY_CONCURRENCY,
                        help="Prefix queries decoded and hashed at once; more wait "
                             f"(default {DEFAULT_QUERY_CONCURRENCY}).")
    add_bootstrap_arguments(parser, by_default=True)
    parser.add_argument("--hybrid-sample", type=int, default=4096,
                        help="Attention blocks sampled per worker rank for the hybrid effect.")
