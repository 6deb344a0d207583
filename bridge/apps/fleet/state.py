"""What `kv-bridge observe` keeps and answers: the residency index fed from
the bus, the worker registry, and the two router-facing queries (workers,
prefix), shared by the HTTP API and the NATS service."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from bridge.client.chain import ALGOS, ChainHasher
from bridge.client.registry import RegistryFollower
from bridge.contract import ATTENTION, STATE, WINDOW, BlockHash
from bridge.residency.index import ResidencyIndex
from bridge.residency.views import WorkerView

MAX_CHAIN = 65_536  # blocks in one query (a 1M-token prompt at block size 16)
MAX_TOKENS = MAX_CHAIN * 64
DEFAULT_LIMIT = 16


class QueryError(ValueError):
    """A query the service cannot answer: the caller's fault (HTTP 400)."""


class PrefixQuery(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /v1/prefix` and the `prefix` NATS endpoint. Either `chain` (block
    hashes in order: ints, or hex strings of vLLM's digests) or `token_ids`
    with `block_size` (and the engine's hashing options) to compute it."""

    chain: list[int | str] | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    algo: str = "sha256"
    seed: str | None = None
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None
    media: list[str] | None = None
    include_suspect: bool = False
    include_dead: bool = False
    min_blocks: int = 1
    limit: int = DEFAULT_LIMIT


def _hash_of(value: int | str) -> BlockHash:
    if type(value) is int:
        if value < 0:
            raise QueryError("a block hash as int must not be negative")
        return value
    text = str(value)
    if text.startswith(("0x", "0X")):
        text = text[2:]
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise QueryError(f"not a hex block hash: {value!r}") from None


def query_chain(q: PrefixQuery) -> list[BlockHash]:
    if (q.chain is None) == (q.token_ids is None):
        raise QueryError("give exactly one of 'chain' and 'token_ids'")
    if q.chain is not None:
        if len(q.chain) > MAX_CHAIN:
            raise QueryError(f"chain longer than {MAX_CHAIN} blocks")
        return [_hash_of(v) for v in q.chain]
    assert q.token_ids is not None
    if not q.block_size or q.block_size <= 0:
        raise QueryError("'token_ids' needs a positive 'block_size'")
    if len(q.token_ids) > MAX_TOKENS:
        raise QueryError(f"more than {MAX_TOKENS} token ids")
    if q.algo not in ALGOS:
        raise QueryError(f"unknown algo {q.algo!r} (one of {', '.join(ALGOS)})")
    try:
        hasher = ChainHasher(q.block_size, algo=q.algo, seed=q.seed)
    except ValueError as exc:
        raise QueryError(str(exc)) from None
    out: list[BlockHash] = list(hasher.chain(q.token_ids, lora=q.lora, cache_salt=q.cache_salt))
    return out


class ObserveState:
    """The index and the registry of one observe process, and its query counters."""

    def __init__(self, follower: RegistryFollower | None = None) -> None:
        self.index = ResidencyIndex()
        self.follower = follower
        self.started = time.time()
        self.bus_messages = 0
        self.undecodable = 0
        self.subscribed = False
        self.nats_connected = False
        self.queries: Counter[tuple[str, str]] = Counter()  # (transport, result)
        self.query_seconds: dict[str, list[float]] = {}  # transport → [sum, count]
        # Per worker: blocks the attention group alone allowed, and the hybrid answer (queries answered).
        self.prefix_blocks: Counter[tuple[str, str]] = Counter()

    # -- liveness --------------------------------------------------------

    def liveness(self, view: WorkerView, now: float) -> str:
        status = self.follower.status(view.key.worker, now) if self.follower is not None else None
        if status is not None:
            return status
        return "watching" if view.watching else "stopped"

    # -- the queries -----------------------------------------------------

    def workers(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        out = []
        for view in sorted(self.index, key=lambda v: v.key):
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
                "worker": view.key.worker, "dp_rank": view.key.dp_rank, "epoch": view.epoch,
                "liveness": self.liveness(view, now), "watching": view.watching, "stale": view.stale,
                "staleness_s": None if not view.last_received else round(max(0.0, now - view.last_received), 3),
                "lag_s": None if view.lag is None else round(view.lag, 6),
                "last_seq": view.last_seq, "gaps": view.gaps, "restarts": view.restarts, "clears": view.clears,
                "groups": groups,
            })
        return {"workers": out, "interruptions": self.index.interruptions, "ts": now}

    def prefix(self, q: PrefixQuery, transport: str, now: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            chain = query_chain(q)
        except QueryError:
            self.queries[(transport, "error")] += 1
            raise
        now = time.time() if now is None else now
        skip = self.follower.dead(now) if (self.follower is not None and not q.include_dead) else set()
        matches = self.index.longest_prefix(chain, media=q.media, include_suspect=q.include_suspect,
                                            skip_workers=skip)
        workers: list[dict[str, Any]] = []
        for m in matches:
            view = self.index.view(m.worker, m.dp_rank)
            attention = self._attention_limit(view, m.limits)
            if attention:
                self.prefix_blocks[(m.worker, "attention")] += attention
                self.prefix_blocks[(m.worker, "hybrid")] += m.blocks
            if m.blocks < max(q.min_blocks, 1) or len(workers) >= max(q.limit, 0):
                continue
            workers.append({
                "worker": m.worker, "dp_rank": m.dp_rank, "blocks": m.blocks, "stale": m.stale,
                "liveness": self.liveness(view, now) if view is not None else "?",
                "staleness_s": None if view is None or not view.last_received
                else round(max(0.0, now - view.last_received), 3),
                "limits": {str(k): v for k, v in sorted(m.limits.items())},
            })
        self.queries[(transport, "hit" if workers else "miss")] += 1
        acc = self.query_seconds.setdefault(transport, [0.0, 0])
        acc[0] += time.perf_counter() - t0
        acc[1] += 1
        return {"chain_blocks": len(chain), "workers": workers}

    @staticmethod
    def _attention_limit(view: WorkerView | None, limits: dict[int, int]) -> int:
        if view is None:
            return 0
        best = [p for group, p in limits.items()
                if (g := view.groups.get(group)) is not None and g.family == ATTENTION]
        return min(best) if best else 0


def hybrid_effect(view: WorkerView, sample: int) -> tuple[int, int, int]:
    """(attention blocks held, of them sampled, of the sample those where every
    window and state group of the worker can resume too), on the GPU tier's
    trusted entries. A block is resumable when each window group holds it and
    each state group has a checkpoint at it: the hybrid rule at the block
    after it (window groups need more than that block, so this is an upper
    bound). Costs `sample` lookups per other group, whatever the fleet size."""
    attention = [g for g in view.groups.values() if g.family == ATTENTION]
    others = [g for g in view.groups.values() if g.family in (WINDOW, STATE)]
    if not attention:
        return 0, 0, 0
    att = attention[0]
    held = sum(att.resident(m) for m in att.media())
    if not held:
        return 0, 0, 0
    taken = 0
    ok = 0
    for medium in att.media():
        table = att.trusted.get(medium)
        if table is None:
            continue
        for h in _first(table, sample - taken):
            taken += 1
            if all(any(g.count(m, h) for m in g.media()) for g in others):
                ok += 1
        if taken >= sample:
            break
    return held, taken, ok


def _first(table: Any, n: int) -> Sequence[BlockHash]:
    out: list[BlockHash] = []
    if n <= 0:
        return out
    for h in table:
        out.append(h)
        if len(out) >= n:
            break
    return out
