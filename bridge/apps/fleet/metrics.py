"""`kv-bridge observe`'s /metrics: the cluster's state, read from the index at
scrape time (counters the index keeps, no per-hash work), with bounded
cardinality: labels are worker, model (one per worker: its registry
entry's), dp_rank, group, family, medium, layer and a
few fixed enums; never a hash or a request. Past `max_workers` worker ranks
the per-worker families stop listing more (`kvobserve_unlisted_worker_ranks`
says how many were left out); fleet-wide families still count everything."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bridge import __version__
from bridge.apps.fleet.scope import model_of
from bridge.apps.fleet.state import ObserveState
from bridge.residency.views import WorkerKey, WorkerView

LIVENESS = ("alive", "dead", "stopped")
TRANSPORTS = ("http", "nats")
RESULTS = ("hit", "miss", "error")


class HybridCache:
    """Per worker rank: (attention blocks, sampled, resumable of the sample),
    refreshed every so often by the service (it walks entries, so not per scrape)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], tuple[int, int, int]] = {}
        self.updated = 0.0


class ObserveCollector(Collector):
    def __init__(self, state: ObserveState, hybrid: HybridCache, max_workers: int = 1000) -> None:
        self.state = state
        self.hybrid = hybrid
        self.max_workers = max_workers

    def collect(self) -> Iterator[Metric]:  # noqa: C901 - one flat list of families
        st = self.state
        index = st.index
        now = time.time()
        info = GaugeMetricFamily("kvobserve_info", "kv-bridge observe: version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        up = GaugeMetricFamily("kvobserve_nats_connected", "1 while connected to NATS and subscribed.")
        up.add_metric([], 1 if st.nats_connected and st.subscribed else 0)
        yield up
        msgs = CounterMetricFamily("kvobserve_bus_messages", "Bus messages applied to the index.")
        msgs.add_metric([], st.bus_messages)
        yield msgs
        bad = CounterMetricFamily("kvobserve_bus_undecodable", "Bus messages that were not the contract's.")
        bad.add_metric([], st.undecodable)
        yield bad
        refused = CounterMetricFamily("kvobserve_requests_refused",
                                      "NATS requests left unanswered: their reply subject is no inbox (_INBOX.).")
        refused.add_metric([], st.requests_refused)
        yield refused
        intr = CounterMetricFamily("kvobserve_interruptions",
                                   "This consumer's own gaps (NATS disconnects, slow-consumer drops).")
        intr.add_metric([], index.interruptions)
        yield intr

        registered = st.entries()

        def model(worker: str) -> str:
            """The worker's model, from its registry entry ('' when unknown)."""
            return model_of(registered.get(worker))

        views = sorted(index, key=lambda v: v.key)
        listed = views[: self.max_workers]
        keys = {v.key for v in listed}
        unlisted = GaugeMetricFamily("kvobserve_unlisted_worker_ranks",
                                     "Worker ranks left out of per-worker families (over --max-worker-series).")
        unlisted.add_metric([], len(views) - len(listed))
        yield unlisted
        ranks = GaugeMetricFamily("kvobserve_worker_ranks", "Worker ranks the index holds a view of.")
        ranks.add_metric([], len(views))
        yield ranks

        resident = GaugeMetricFamily(
            "kvobserve_resident_blocks",
            "Distinct block hashes held, per worker rank, group, family, medium and layer (trusted, suspect).",
            labels=["worker", "model", "dp_rank", "group", "family", "medium", "layer"])
        fleet = getattr(index, "fleet", None)
        counts = fleet.resident_counts() if fleet is not None else _view_counts(listed)
        for c in counts:
            if WorkerKey(c.worker, c.dp_rank) not in keys:
                continue
            base = [c.worker, model(c.worker), str(c.dp_rank), str(c.group), c.family, c.medium]
            resident.add_metric([*base, "trusted"], c.trusted)
            resident.add_metric([*base, "suspect"], c.suspect)
        yield resident

        fleet_hashes = GaugeMetricFamily("kvobserve_fleet_hashes",
                                         "Distinct hashes held by some worker, per group and medium ('any': over media).",
                                         labels=["group", "medium"])
        shared = GaugeMetricFamily("kvobserve_fleet_shared_hashes",
                                   "Distinct hashes held by more than one worker rank (duplication), per group and medium.",
                                   labels=["group", "medium"])
        entries = GaugeMetricFamily("kvobserve_fleet_entries",
                                    "(worker rank, hash) entries, per group and medium.", labels=["group", "medium"])
        for h in (fleet.hash_counts() if fleet is not None else _view_hash_counts(views)):
            labels = [str(h.group), h.medium if h.medium is not None else "any"]
            fleet_hashes.add_metric(labels, h.hashes)
            shared.add_metric(labels, h.shared)
            if h.medium is not None:
                entries.add_metric(labels, h.entries)
        yield fleet_hashes
        yield shared
        yield entries

        stored = CounterMetricFamily("kvobserve_stored_blocks", "Block hashes stored, per worker rank and group "
                                     "(since the view's last reset).", labels=["worker", "model", "dp_rank", "group", "family"])
        removed = CounterMetricFamily("kvobserve_removed_blocks", "Block hashes removed (known or not), per worker "
                                      "rank and group.", labels=["worker", "model", "dp_rank", "group", "family"])
        per = {
            "gaps": ("Gap records seen.", "gaps"),
            "restarts": ("Restarts seen (a new vLLM process).", "restarts"),
            "clears": ("Cleared records seen.", "clears"),
            "duplicates_ignored": ("Group messages ignored as copies.", "duplicates_ignored"),
        }
        per_families = {name: CounterMetricFamily(f"kvobserve_{name}", doc, labels=["worker", "model", "dp_rank"])
                        for name, (doc, _) in per.items()}
        lag = GaugeMetricFamily("kvobserve_lag_seconds", "Receive time minus vLLM's batch ts, last batch.",
                                labels=["worker", "model", "dp_rank"])
        staleness = GaugeMetricFamily("kvobserve_staleness_seconds", "Seconds since the last message of the worker "
                                      "rank.", labels=["worker", "model", "dp_rank"])
        stale = GaugeMetricFamily("kvobserve_stale", "1 while the view holds suspect entries (a gap since its "
                                  "reset) or is partial (started without a whole snapshot).",
                                  labels=["worker", "model", "dp_rank"])
        watching = GaugeMetricFamily("kvobserve_watching", "1 while the worker's bridge watches it.",
                                     labels=["worker", "model", "dp_rank"])
        last_seq = GaugeMetricFamily("kvobserve_last_seq", "vLLM batch seq of the last message.",
                                     labels=["worker", "model", "dp_rank"])
        for v in listed:
            wl = [v.key.worker, model(v.key.worker), str(v.key.dp_rank)]
            for group, g in sorted(v.groups.items()):
                gl = [*wl, str(group), g.family]
                stored.add_metric(gl, g.stored)
                removed.add_metric(gl, g.removed + g.unknown_removals)
            for name, (_, attr) in per.items():
                per_families[name].add_metric(wl, getattr(v, attr))
            lag.add_metric(wl, v.lag or 0.0)
            heard = st.last_heard(v)
            staleness.add_metric(wl, max(0.0, now - (heard if heard is not None else st.started)))
            stale.add_metric(wl, 1 if v.stale else 0)
            watching.add_metric(wl, 1 if v.watching else 0)
            last_seq.add_metric(wl, v.last_seq if v.last_seq is not None else -1)
        yield stored
        yield removed
        yield from per_families.values()
        yield lag
        yield staleness
        yield stale
        yield watching
        yield last_seq

        att = GaugeMetricFamily("kvobserve_hybrid_attention_blocks", "Distinct attention-group blocks held "
                                "(trusted, in any tier: a block on GPU and CPU counts once), per worker rank.",
                                labels=["worker", "model", "dp_rank"])
        ratio = GaugeMetricFamily(
            "kvobserve_hybrid_resumable_ratio",
            "Of the attention group's blocks, the share where every window and state group of the worker can "
            "resume too (sampled): the hybrid effect.", labels=["worker", "model", "dp_rank"])
        for (worker, rank), (held, taken, ok) in sorted(self.hybrid.values.items()):
            if (worker, rank) not in keys:
                continue
            att.add_metric([worker, model(worker), str(rank)], held)
            ratio.add_metric([worker, model(worker), str(rank)], ok / taken if taken else 0.0)
        yield att
        yield ratio

        reg = GaugeMetricFamily("kvobserve_registry_workers", "Workers in the registry, by liveness.",
                                labels=["liveness"])
        tally = dict.fromkeys(LIVENESS, 0)
        if st.follower is not None:
            for w in st.follower.entries:
                found = st.follower.status(w, now)
                if found is not None:
                    tally[found] = tally.get(found, 0) + 1
        for name, n in tally.items():
            reg.add_metric([name], n)
        yield reg

        q = CounterMetricFamily("kvobserve_prefix_queries", "Prefix queries answered, by transport and result.",
                                labels=["transport", "result"])
        for t in TRANSPORTS:
            for r in RESULTS:
                q.add_metric([t, r], st.queries[(t, r)])
        yield q
        qs = CounterMetricFamily("kvobserve_prefix_query_seconds", "Time spent answering prefix queries.",
                                 labels=["transport"])
        for t in TRANSPORTS:
            qs.add_metric([t], st.query_seconds.get(t, [0.0, 0])[0])
        yield qs
        pb = CounterMetricFamily(
            "kvobserve_prefix_blocks", "Blocks of queried chains a worker could reuse: by its attention group "
            "alone (rule=attention) and by the hybrid rule (rule=hybrid).", labels=["worker", "model", "rule"])
        listed_workers = {k.worker for k in keys}
        for (worker, rule), n in sorted(st.prefix_blocks.items()):
            if worker in listed_workers:
                pb.add_metric([worker, model(worker), rule], n)
        yield pb


class _Count(NamedTuple):
    worker: str
    dp_rank: int
    group: int
    family: str
    medium: str
    trusted: int
    suspect: int


def _view_counts(views: list[WorkerView]) -> list[_Count]:
    """Resident counts from the views' public API, for an index without the
    fleet structure's aggregates (and so without the duplication families)."""
    out = []
    for v in views:
        for group, g in sorted(v.groups.items()):
            for medium in sorted(g.media()):
                out.append(_Count(v.key.worker, v.key.dp_rank, group, g.family, medium, g.resident(medium),
                                  g.suspect_count(medium)))
    return out


class _HashCount(NamedTuple):
    group: int
    medium: str | None  # None: over every medium
    hashes: int
    shared: int
    entries: int


def _view_hash_counts(views: list[WorkerView]) -> list[_HashCount]:
    """Duplication from the views' trusted tables, for an index without the
    fleet structure's aggregates: one pass over every resident entry."""
    holders: dict[tuple[int, str | None], dict[object, int]] = {}
    for v in views:
        for group, g in v.groups.items():
            seen_any: set[object] = set()
            for medium, table in g.trusted.items():
                per = holders.setdefault((group, medium), {})
                for h in table:
                    per[h] = per.get(h, 0) + 1
                seen_any.update(table)
            per_any = holders.setdefault((group, None), {})
            for held in seen_any:
                per_any[held] = per_any.get(held, 0) + 1
    return [
        _HashCount(group, medium, len(per), sum(1 for n in per.values() if n > 1), sum(per.values()))
        for (group, medium), per in sorted(holders.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
    ]


def make_registry(state: ObserveState, hybrid: HybridCache, max_workers: int) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ObserveCollector(state, hybrid, max_workers))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
