"""Prometheus metrics of one bridge process, on a registry of its own.

The per-batch ones are plain Python numbers exported by a collector at scrape
time: prometheus_client takes a lock and validates on every `inc()`, which on
the hot path cost more than some of the work it counts. Everything runs on the
event loop's one thread, scrapes included, so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from bridge.contract import FAMILIES
from bridge.contract.identity import Refusal

MALFORMED_REASONS = (
    "frame_count", "bad_seq", "too_large", "bad_topic", "bad_batch", "bad_event", "unknown_event_type",
    "unencodable", "too_large_for_nats", "bad_group", "too_many_messages", "too_many_events",
)
DROPPED_REASONS = (
    "window_placeholder", "duplicate", "queue_overflow", "foreign_topic", "state_no_hash", "repeated_clear",
)
# Why a gap record names a range: lost on the way (replay_incomplete,
# replay_timeout, no_replay_endpoint, queue_overflow), not publishable
# (unpublishable, refused), received but not wholly decodable (malformed), or
# stored by JetStream after a later batch of the same worker and rank, which a
# reader that takes anything at or before its last applied for a copy drops
# (reordered), or handed (core mode) to a NATS client that was then closed
# for good before the server confirmed it (connection_closed).
GAP_REASONS = (
    "replay_incomplete", "replay_timeout", "no_replay_endpoint", "queue_overflow", "unpublishable", "refused",
    "malformed", "reordered", "connection_closed",
)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


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


class Count:
    """One counter value; `inc` as prometheus_client's, without its lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Level:
    """One gauge value, set from the hot path."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


class CountBy(dict[str, Count]):
    """Label value → its Count, made on first use (or up front, to show as 0)."""

    def __init__(self, values: tuple[str, ...] = ()) -> None:
        super().__init__((value, Count()) for value in values)

    def __missing__(self, value: str) -> Count:
        child = self[value] = Count()
        return child


class LevelBy(dict[str, Level]):
    def __missing__(self, value: str) -> Level:
        child = self[value] = Level()
        return child


class Buckets:
    """A histogram: per-bucket counts, made cumulative only when scraped."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out


class _HotCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield _counter("kvbridge_batches_in", "vLLM batches received (live and replayed).", m.batches_in)
        yield _counter("kvbridge_events_in", "vLLM events decoded.", m.events_in)
        yield _counter_by("kvbridge_events_out", "Events published to NATS, by family.", "family", m.events_out_by)
        yield _counter_by("kvbridge_messages_out",
                          "NATS messages published, by family (worker records: family=worker).",
                          "family", m.messages_out_by)
        yield _counter("kvbridge_batches_out", "vLLM batches fully handed to NATS.", m.batches_out)
        yield _counter_by("kvbridge_dropped", "Events or batches dropped on purpose, by reason.", "reason",
                          m.dropped_by)
        yield _counter_by("kvbridge_transformed", "Events changed by normalization, by what was done.", "what",
                          m.transformed_by)
        yield GaugeMetricFamily("kvbridge_queue_depth", "Batches waiting for NATS.", value=m.queue_depth.value)
        seq = GaugeMetricFamily("kvbridge_last_seq", "Last vLLM seq handed to NATS.", labels=["dp_rank"])
        for rank, level in sorted(m.last_seq.items()):
            seq.add_metric([rank], level.value)
        yield seq
        yield HistogramMetricFamily("kvbridge_lag_seconds", "vLLM batch timestamp to NATS publish.",
                                    buckets=m.lag.cumulative(), sum_value=m.lag.total)
        yield _counter("kvbridge_js_window_waits", "Times publishing waited for JetStream acks (the ack window was full).",
                       m.js_window_waits)
        yield _counter("kvbridge_js_window_wait_seconds",
                       "Seconds publishing waited for JetStream acks (the ack window was full).", m.js_window_wait_s)
        messages, size = m._js_in_flight()
        yield GaugeMetricFamily("kvbridge_js_in_flight_messages", "JetStream publishes awaiting their ack.",
                                value=messages)
        yield GaugeMetricFamily("kvbridge_js_in_flight_bytes", "Encoded bytes of JetStream publishes awaiting their ack.",
                                value=size)
        entries, log_bytes, shed, undecodable = m._residency()
        yield GaugeMetricFamily("kvbridge_residency_entries",
                                "(rank, group, medium, hash) entries the bridge's own residency holds (snapshots).",
                                value=entries)
        yield GaugeMetricFamily("kvbridge_residency_log_bytes",
                                "Encoded bytes published but not yet applied to the bridge's residency.",
                                value=log_bytes)
        yield CounterMetricFamily("kvbridge_residency_shed_messages",
                                  "Messages let go unapplied because the bridge was too busy to apply them "
                                  "(their ranks' snapshots turn stale and partial).", value=shed)
        yield CounterMetricFamily("kvbridge_residency_undecodable_messages",
                                  "Messages the bridge's residency could not read, its own or read back from its "
                                  "stream (their ranks' snapshots turn partial).", value=undecodable)
        refused = CounterMetricFamily("kvbridge_residency_refused_messages",
                                      "Messages a rebuild of the bridge's residency read back from its stream and "
                                      "refused, by reason: not the bridge's own (a reply copy, a payload naming "
                                      "another worker, rank or group than its subject).", labels=["reason"])
        counts = m._residency_refused()
        for why in Refusal:
            refused.add_metric([why.value], counts.get(why, 0))
        yield refused


def _nothing_in_flight() -> tuple[int, int]:
    return (0, 0)


def _no_residency() -> tuple[int, int, int, int]:
    return (0, 0, 0, 0)


def _no_refusals() -> Mapping[Refusal, int]:
    return {}


def _counter(name: str, doc: str, count: Count) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=count.value)


def _counter_by(name: str, doc: str, label: str, counts: dict[str, Count]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count.value)
    return family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("kvbridge_info", "Bridge build and identity.", ["version", "worker"], registry=r)
        malformed = Counter(
            "kvbridge_malformed_total", "Frames, batches or events rejected as malformed, by reason.", ["reason"],
            registry=r,
        )
        gaps = Counter(
            "kvbridge_gaps_total", f"Gap records published (lost or incomplete ranges), by reason: {', '.join(GAP_REASONS)}.",
            ["reason"], registry=r,
        )
        self.gap_batches = Counter("kvbridge_gap_batches_total", "vLLM batches announced lost.", registry=r)
        replays = Counter(
            "kvbridge_replays_total", "Replay requests, by result (complete, timeout, probe: an idle-time check).",
            ["result"], registry=r,
        )
        self.replayed_batches = Counter(
            "kvbridge_replayed_batches_total", "Batches recovered through replay.", registry=r
        )
        self.restarts = Counter("kvbridge_restarts_total", "vLLM publisher restarts seen (seq went back).", registry=r)
        self.nats_connected = Gauge("kvbridge_nats_connected", "1 while connected to NATS.", registry=r)
        self.nats_reconnects = Counter("kvbridge_nats_reconnects_total", "NATS reconnections.", registry=r)
        self.nats_disconnects = Counter("kvbridge_nats_disconnects_total", "NATS disconnections.", registry=r)
        self.nats_clients_replaced = Counter(
            "kvbridge_nats_clients_replaced_total",
            "NATS clients closed for good (a server error, say) and replaced by a new connection.", registry=r,
        )
        self.publish_errors = Counter(
            "kvbridge_publish_errors_total", "NATS publish attempts that failed (retried).", registry=r
        )
        self.js_refused = Counter(
            "kvbridge_js_refused_total",
            "JetStream messages given up after the stream refused them repeatedly (their batch is named by a gap).",
            registry=r,
        )
        self.js_recoveries = Counter(
            "kvbridge_js_recoveries_total",
            "Times JetStream publishing paused on a lost ack (no ack for a while, an error reply, an ack that "
            "overtook an older one, a reconnect) until the oldest unacked message was stored again.",
            registry=r,
        )
        self.js_reordered = Counter(
            "kvbridge_js_reordered_total",
            "vLLM batches JetStream stored after a later batch of the same worker and rank (each named by a "
            "gap record, reason reordered).",
            registry=r,
        )
        self.snapshot_requests = Counter(
            "kvbridge_snapshot_requests_total",
            "Snapshot service requests, by result (taken, part, expired, unknown_rank, bad_request).",
            ["result"], registry=r,
        )
        self.snapshot_writes = Counter(
            "kvbridge_snapshot_writes_total", "Snapshots written to the JetStream bucket, by result (written, failed).",
            ["result"], registry=r,
        )
        self.snapshot_bytes = Gauge("kvbridge_snapshot_bytes", "Encoded size of the last snapshot taken.", registry=r)
        self.snapshot_seconds = Counter(
            "kvbridge_snapshot_seconds_total", "Time spent taking snapshots for the service (applying the log, "
            "encoding).", registry=r,
        )
        read_back_refused = Counter(
            "kvbridge_read_back_refused_total",
            "Messages on the bridge's own subjects, read back for its resume point, that it did not publish "
            "(a copy stored there by someone's read, a payload naming another worker), by reason.",
            ["reason"], registry=r,
        )
        self.nats_permission_denied = Counter(
            "kvbridge_nats_permission_denied_total",
            "Permission violations the NATS server reported, by operation (publish, subscribe).",
            ["operation"], registry=r,
        )
        # Labelled counters are used through their children, by label value.
        # Reasons are bound up front, so each shows (as 0) before it first
        # happens; other values are bound on first use.
        self.malformed_by = Children(malformed, MALFORMED_REASONS)
        self.gaps_by = Children(gaps, GAP_REASONS)
        self.replays_by = Children(replays)
        self.read_back_refused_by = Children(read_back_refused)
        # The hot path's own, exported by _HotCollector under the same names.
        self.batches_in = Count()
        self.events_in = Count()
        self.batches_out = Count()
        self.events_out_by = CountBy(FAMILIES)
        self.messages_out_by = CountBy((*FAMILIES, "worker"))
        self.dropped_by = CountBy(DROPPED_REASONS)
        self.transformed_by = CountBy()
        self.last_seq = LevelBy()
        self.queue_depth = Level()
        self._js_in_flight: Callable[[], tuple[int, int]] = _nothing_in_flight
        self._residency: Callable[[], tuple[int, int, int, int]] = _no_residency
        self._residency_refused: Callable[[], Mapping[Refusal, int]] = _no_refusals
        self.lag = Buckets(LAG_BUCKETS)
        self.js_window_waits = Count()
        self.js_window_wait_s = Count()
        r.register(_HotCollector(self))

    def watch_in_flight(self, read: Callable[[], tuple[int, int]]) -> None:
        """`read` says (messages, bytes) awaiting a JetStream ack: the sink's
        ack window registers it once it exists, and scrapes call it."""
        self._js_in_flight = read

    def watch_residency(self, read: Callable[[], tuple[int, int, int, int]],
                        refused: Callable[[], Mapping[Refusal, int]] = _no_refusals) -> None:
        """`read` says (entries held, log bytes not yet applied, messages shed, messages it could
        not read) of the bridge's residency (`ResidencyKeeper.levels`); `refused`, the messages
        its rebuilds refused, per reason (`ResidencyKeeper.refusals`)."""
        self._residency = read
        self._residency_refused = refused

    def render(self) -> bytes:
        return generate_latest(self.registry)
