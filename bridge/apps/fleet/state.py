"""What `kv-bridge observe` keeps and answers: the residency index fed from
the bus, the worker registry, and the two router-facing queries (workers,
prefix), shared by the HTTP API and the NATS service."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Generator, Mapping
from typing import Any

from bridge.apps.fleet.query import MAX_CHAIN, PrefixQuery, QueryError
from bridge.apps.fleet.scope import Scope, model_of, out_of_scope, tenant_of
from bridge.client.registry import RegistryFollower
from bridge.contract import ATTENTION, STATE, WINDOW, BlockHash, WorkerEntry
from bridge.residency.index import ResidencyIndex
from bridge.residency.prefix import PrefixMatch
from bridge.residency.views import GroupResidency, WorkerKey, WorkerView

__all__ = ["MAX_CHAIN", "ObserveState", "PrefixQuery", "QueryError", "hybrid_effect"]

# Ranks forgotten on expiry that the service still remembers, so one that
# speaks again without a record that resets it comes back partial.
MAX_EXPIRED_REMEMBERED = 65_536

class ObserveState:
    """The index and the registry of one observe process, and its query counters."""

    def __init__(self, follower: RegistryFollower | None = None) -> None:
        self.index = ResidencyIndex()
        self.follower = follower
        self.started = time.time()
        self.bus_messages = 0
        self.undecodable = 0
        self.requests_refused = 0  # NATS requests left unanswered: their reply subject is no inbox
        self.subscribed = False
        self.nats_connected = False
        self.queries: Counter[tuple[str, str]] = Counter()  # (transport, result)
        self.query_seconds: dict[str, list[float]] = {}  # transport → [sum, count]
        # Per worker: blocks the attention group alone allowed, and the hybrid answer (queries answered).
        self.prefix_blocks: Counter[tuple[str, str]] = Counter()
        # Per rank: when a bootstrap snapshot was taken, for staleness while no message came since.
        self.snapshot_at: dict[WorkerKey, float] = {}
        # Per worker: since when every rank of it is stopped or dead (expiry).
        self.gone_since: dict[str, float] = {}
        self.expired: dict[WorkerKey, float] = {}  # insertion-ordered: the oldest go first
        self.expired_total = 0

    # -- liveness --------------------------------------------------------

    def liveness(self, view: WorkerView, now: float) -> str:
        status = self.follower.status(view.key.worker, now) if self.follower is not None else None
        if status is not None:
            return status
        return "watching" if view.watching else "stopped"

    def last_heard(self, view: WorkerView) -> float | None:
        """This process's clock at the rank's last message; for a view that came
        from a snapshot and heard nothing since, the snapshot's last batch time
        (vLLM's ts), else the snapshot's time. None: nothing known."""
        if view.last_received:
            return view.last_received
        return self.snapshot_at.get(view.key)

    def staleness(self, view: WorkerView, now: float) -> float | None:
        heard = self.last_heard(view)
        return None if heard is None else round(max(0.0, now - heard), 3)

    # -- expiry ----------------------------------------------------------

    def expire(self, now: float, after: float) -> list[str]:
        """Forget every worker whose ranks have all been stopped or dead for
        `after` seconds: its views, its per-worker counters. Returns them."""
        by_worker: dict[str, bool] = {}
        for view in self.index:
            gone = self.liveness(view, now) in ("stopped", "dead")
            by_worker[view.key.worker] = by_worker.get(view.key.worker, True) and gone
        for worker in [w for w in self.gone_since if w not in by_worker]:
            del self.gone_since[worker]
        for key in [k for k in self.prefix_blocks if k[0] not in by_worker]:
            del self.prefix_blocks[key]  # its views went (forgotten): so do its series
        out = []
        for worker, gone in by_worker.items():
            if not gone:
                self.gone_since.pop(worker, None)
                continue
            since = self.gone_since.setdefault(worker, now)
            if now - since >= after:
                out.append(worker)
        for worker in out:
            self.forget(worker, now)
        return out

    def forget(self, worker: str, now: float) -> None:
        for view in self.index:
            if view.key.worker == worker:
                self.expired[view.key] = now
                self.snapshot_at.pop(view.key, None)
        self.index.forget(worker)
        self.gone_since.pop(worker, None)
        for rule in ("attention", "hybrid"):
            self.prefix_blocks.pop((worker, rule), None)
        self.expired_total += 1
        while len(self.expired) > MAX_EXPIRED_REMEMBERED:
            del self.expired[next(iter(self.expired))]

    # -- the queries -----------------------------------------------------

    def entries(self) -> Mapping[str, WorkerEntry]:
        """The registry's entries by worker (none without a registry)."""
        return self.follower.entries if self.follower is not None else {}

    def skipped(self, scope: Scope, include_dead: bool, now: float) -> set[str]:
        """Workers a query leaves out: dead or stopped in the registry (unless
        `include_dead`), and those out of its scope. Raises ModelMissing."""
        dead = self.follower.dead(now) if (self.follower is not None and not include_dead) else set()
        workers = {view.key.worker for view in self.index}
        return dead | out_of_scope(scope, workers, self.entries(), hidden=dead)

    def count_query(self, transport: str, hit: bool, seconds: float) -> None:
        self.queries[(transport, "hit" if hit else "miss")] += 1
        acc = self.query_seconds.setdefault(transport, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    def workers(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        out = []
        entries = self.entries()
        for view in sorted(self.index, key=lambda v: v.key):
            entry = entries.get(view.key.worker)
            groups = []
            for group, g in sorted(view.groups.items()):
                media = sorted(g.media())
                groups.append({
                    "group": group, "kind": g.kind, "family": g.family, "block_size": g.block_size,
                    "window": g.window,
                    "resident": {m: g.resident(m) for m in media},
                    "suspect": {m: g.suspect_count(m) for m in media},
                })
            out.append({
                "worker": view.key.worker, "dp_rank": view.key.dp_rank, "model": model_of(entry),
                "tenant": tenant_of(entry), "epoch": view.epoch,
                "liveness": self.liveness(view, now), "watching": view.watching, "stale": view.stale,
                "staleness_s": self.staleness(view, now),
                "lag_s": None if view.lag is None else round(view.lag, 6),
                "last_seq": view.last_seq, "gaps": view.gaps, "restarts": view.restarts, "clears": view.clears,
                "groups": groups,
            })
        return {"workers": out, "interruptions": self.index.interruptions, "ts": now}

    def prefix(self, q: PrefixQuery, chain: list[BlockHash], transport: str, now: float | None = None,
               spent: float = 0.0) -> dict[str, Any]:
        """The answer to `q`, whose chain (`query.query_chain`) is `chain`;
        `spent`: seconds already spent on it (decoding, hashing)."""
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        skip = self.skipped(Scope(q.model or None, q.tenant), q.include_dead, now)  # an empty model names none
        # Stopped ranks are left out like dead ones, unless asked for.
        matches = self.index.longest_prefix(chain, media=q.media, include_suspect=q.include_suspect,
                                            include_unwatched=q.include_dead, skip_workers=skip)
        workers: list[dict[str, Any]] = []
        enough = max(q.min_blocks, 1)
        chosen = []
        for m in matches:
            view = self.count_reuse(m)
            if m.blocks >= enough:
                chosen.append((m, view))
        # Deepest first; ties in worker order, whatever order the index met them in.
        chosen.sort(key=lambda mv: (-mv[0].blocks, mv[0].worker, mv[0].dp_rank))
        for m, view in chosen[:max(q.limit, 0)]:
            workers.append({
                "worker": m.worker, "dp_rank": m.dp_rank, "blocks": m.blocks, "stale": m.stale,
                "liveness": self.liveness(view, now) if view is not None else "?",
                "staleness_s": None if view is None else self.staleness(view, now),
                "limits": {str(k): v for k, v in sorted(m.limits.items())},
            })
        self.count_query(transport, bool(workers), time.perf_counter() - t0 + spent)
        return {"chain_blocks": len(chain), "workers": workers}

    def count_reuse(self, m: PrefixMatch) -> WorkerView | None:
        """Add a worker's answer to its reuse counters; its view."""
        view = self.index.view(m.worker, m.dp_rank)
        attention = self._attention_limit(view, m.limits)
        if attention:
            self.prefix_blocks[(m.worker, "attention")] += attention
            self.prefix_blocks[(m.worker, "hybrid")] += m.blocks
        return view

    @staticmethod
    def _attention_limit(view: WorkerView | None, limits: dict[int, int]) -> int:
        if view is None:
            return 0
        best = [p for group, p in limits.items()
                if (g := view.groups.get(group)) is not None and g.family == ATTENTION]
        return min(best) if best else 0


def hybrid_effect(view: WorkerView, sample: int) -> tuple[int, int, int]:
    """(attention blocks held, of them sampled, of the sample those where every
    window and state group of the worker can resume too), on the attention
    group's trusted entries (a block in two tiers counted once). A block is
    resumable when each window group holds it and each state group has a
    checkpoint at it: the hybrid rule at the block after it (window groups
    need more than that block, so this is an upper bound). Costs `sample`
    lookups per other group, whatever the fleet size."""
    steps = hybrid_steps(view, sample)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def hybrid_steps(view: WorkerView, sample: int, every: int = 256) -> Generator[None, None, tuple[int, int, int]]:
    """`hybrid_effect` a slice at a time: it yields after every `every`
    sampled blocks (the caller may let others run) and returns the figures.
    What changes between slices changes the sample, not its bounds."""
    attention = [g for g in view.groups.values() if g.family == ATTENTION]
    others = [(g, sorted(g.media())) for g in view.groups.values() if g.family in (WINDOW, STATE)]
    if not attention:
        return 0, 0, 0
    att = attention[0]
    held = yield from distinct_held_steps(att)
    if not held:
        return 0, 0, 0
    taken = 0
    ok = 0
    seen: set[BlockHash] = set()  # a block in two tiers is sampled once
    for medium in sorted(att.media()):
        # At most len(seen) of them were sampled in an earlier tier already.
        for h in att.sample(medium, sample - taken + len(seen)):
            if h in seen:
                continue
            seen.add(h)
            taken += 1
            if all(any(g.count(m, h) for m in media) for g, media in others):
                ok += 1
            if taken >= sample:
                break
            if taken % every == 0:
                yield
        if taken >= sample:
            break
    return held, taken, ok


def distinct_held(g: GroupResidency) -> int:
    """Distinct trusted hashes of a group over every tier: a block held on
    GPU and CPU counts once."""
    steps = distinct_held_steps(g)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def distinct_held_steps(g: GroupResidency, every: int = 4096) -> Generator[None, None, int]:
    """`distinct_held` a slice at a time (a yield every `every` entries): a
    lookup per entry of every tier but the largest."""
    media = sorted(g.media(), key=g.resident)
    if len(media) <= 1:
        return g.resident(media[0]) if media else 0
    largest = media[-1]
    seen: set[BlockHash] = set()
    n = 0
    for medium in media[:-1]:
        for h in g.trusted[medium]:
            if h not in seen and not g.count(largest, h):
                seen.add(h)
            n += 1
            if n % every == 0:
                yield
    return g.resident(largest) + len(seen)
