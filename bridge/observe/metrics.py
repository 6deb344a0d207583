"""Prometheus metrics of one bridge process, on a registry of its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bridge.normalize.kinds import FAMILIES

MALFORMED_REASONS = (
    "frame_count", "bad_seq", "too_large", "bad_topic", "bad_batch", "bad_event", "unknown_event_type",
    "unencodable", "too_large_for_nats",
)
DROPPED_REASONS = ("window_placeholder", "duplicate", "queue_overflow", "foreign_topic")


class Children(dict[str, Any]):
    """Label value → the metric's child for it, bound once: `labels()` validates
    and locks on every call, too slow for a per-batch path."""

    def __init__(self, metric: Any, values: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._metric = metric
        for value in values:
            self[value] = metric.labels(value)

    def __missing__(self, value: str) -> Any:
        child = self[value] = self._metric.labels(value)
        return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("kvbridge_info", "Bridge build and identity.", ["version", "worker"], registry=r)
        self.batches_in = Counter("kvbridge_batches_in_total", "vLLM batches received (live and replayed).", registry=r)
        self.events_in = Counter("kvbridge_events_in_total", "vLLM events decoded.", registry=r)
        self.events_out = Counter(
            "kvbridge_events_out_total", "Events published to NATS, by family.", ["family"], registry=r
        )
        self.messages_out = Counter(
            "kvbridge_messages_out_total", "NATS messages published, by family (worker records: family=worker).",
            ["family"], registry=r,
        )
        self.batches_out = Counter("kvbridge_batches_out_total", "vLLM batches fully handed to NATS.", registry=r)
        self.dropped = Counter(
            "kvbridge_dropped_total", "Events or batches dropped on purpose, by reason.", ["reason"], registry=r
        )
        self.malformed = Counter(
            "kvbridge_malformed_total", "Frames, batches or events rejected as malformed, by reason.", ["reason"],
            registry=r,
        )
        self.transformed = Counter(
            "kvbridge_transformed_total", "Events changed by normalization, by what was done.", ["what"], registry=r
        )
        self.gaps = Counter("kvbridge_gaps_total", "Gap records published (lost ranges).", ["reason"], registry=r)
        self.gap_batches = Counter("kvbridge_gap_batches_total", "vLLM batches announced lost.", registry=r)
        self.replays = Counter(
            "kvbridge_replays_total", "Replay requests, by result (complete, timeout, probe: an idle-time check).",
            ["result"], registry=r,
        )
        self.replayed_batches = Counter(
            "kvbridge_replayed_batches_total", "Batches recovered through replay.", registry=r
        )
        self.restarts = Counter("kvbridge_restarts_total", "vLLM publisher restarts seen (seq went back).", registry=r)
        self.queue_depth = Gauge("kvbridge_queue_depth", "Batches waiting for NATS.", registry=r)
        self.nats_connected = Gauge("kvbridge_nats_connected", "1 while connected to NATS.", registry=r)
        self.nats_reconnects = Counter("kvbridge_nats_reconnects_total", "NATS reconnections.", registry=r)
        self.nats_disconnects = Counter("kvbridge_nats_disconnects_total", "NATS disconnections.", registry=r)
        self.publish_errors = Counter(
            "kvbridge_publish_errors_total", "NATS publish attempts that failed (retried).", registry=r
        )
        self.last_seq = Gauge("kvbridge_last_seq", "Last vLLM seq handed to NATS.", ["dp_rank"], registry=r)
        self.lag = Histogram(
            "kvbridge_lag_seconds", "vLLM batch timestamp to NATS publish.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        # Children bound once: label lookups are not free on the hot path.
        self.events_out_by = {f: self.events_out.labels(f) for f in FAMILIES}
        self.messages_out_by = {f: self.messages_out.labels(f) for f in (*FAMILIES, "worker")}
        # Bound up front, so every reason shows (as 0) before it first happens;
        # other values are bound on first use.
        self.malformed_by = Children(self.malformed, MALFORMED_REASONS)
        self.dropped_by = Children(self.dropped, DROPPED_REASONS)
        self.transformed_by = Children(self.transformed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
