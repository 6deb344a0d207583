"""The worker registry: one JetStream key-value entry per worker, kept fresh by
heartbeats, so consumers can list workers and tell live ones from dead ones.

Bucket: `--registry-bucket` (default `kv_workers`), created on first use with
`history=1` and a `ttl` (entries nobody refreshes vanish after it). Key: the
worker's subject token (`worker_token(worker, 0)`) with `~` written as `=`,
because KV keys allow `[-/_=.A-Za-z0-9]` and the token alphabet never holds
`=`, so the mapping stays injective. Value: a `WorkerEntry` as JSON, so
`nats kv get kv_workers <key>` is readable.

A reader calls a worker dead when `now - heartbeat_ts > dead_after ×
heartbeat_interval` (the entry carries its own interval, so readers need no
configuration), and stopped when the bridge wrote `state="stopped"` on exit.

What the entry says about groups and seqs comes from the batches the bridge
hands to NATS (`GroupCatalog.observe`), i.e. from the same headers and
payloads consumers see, not from the pipeline's internals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import anyio
import msgspec
import nats.js
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from bridge import __version__
from bridge.contract import HDR_FAMILY, HDR_FORMAT, HDR_KIND, HDR_SEQ
from bridge.normalize.kinds import MAX_GROUP_ID, UNKNOWN_KIND, WINDOW
from bridge.sink.encode import decoder_for
from bridge.sink.queue import BatchQueue, OutBatch
from bridge.sink.subjects import worker_token

log = structlog.get_logger("bridge.registry")

REGISTRY_VERSION: Final = 1
DEFAULT_DEAD_AFTER: Final = 3.0
# While a group's block size (or window) is unknown, decode one message in this
# many to learn it; the rest of the time the catalog reads headers only.
_SAMPLE_EVERY: Final = 16

Liveness = Literal["alive", "dead", "stopped"]


class GroupInfo(msgspec.Struct, omit_defaults=True):
    group: int
    kind: str
    family: str
    block_size: int = 0  # tokens per block; 0 until a store names it
    sliding_window: int | None = None  # tokens, window groups only


class _StoredSizes(msgspec.Struct, tag="BlockStored", gc=False):
    """What the catalog reads of a store; its hashes and tokens are skipped
    unread, so sampling a large message costs no objects per hash."""

    block_size: int = 0
    kv_cache_spec_sliding_window: int | None = None
    placeholder: bool = False


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    pass


class _SizesOnly(msgspec.Struct, gc=False):
    """A GroupMessage as the catalog reads it."""

    events: list[_StoredSizes | _Removed]


class RankInfo(msgspec.Struct, omit_defaults=True):
    dp_rank: int
    epoch: int = 0
    # Last vLLM batch seq this bridge handed to NATS for the rank (None: none yet).
    last_seq: int | None = None


class WorkerEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = REGISTRY_VERSION
    worker: str
    topic: str = ""
    model: str = ""
    subject_prefix: str = "kv"
    ranks: list[RankInfo]
    groups: list[GroupInfo]
    bridge_version: str = __version__
    started_at: float
    heartbeat_ts: float = 0.0
    heartbeat_interval: float
    state: Literal["running", "stopped"] = "running"


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(WorkerEntry).decode


def registry_key(worker: str) -> str:
    return worker_token(worker, 0).replace("~", "=")


def encode_entry(entry: WorkerEntry) -> bytes:
    return _encode(entry)


def decode_entry(data: bytes) -> WorkerEntry:
    """Raises msgspec.DecodeError on anything that is not an entry."""
    return _decode(data)


def ttl_for(heartbeat_interval: float) -> float:
    """A bucket TTL for an interval: long enough that `watch` shows a dead worker
    as dead for a while before its entry vanishes."""
    return max(60.0, 12 * heartbeat_interval)


def liveness(entry: WorkerEntry, now: float | None = None, dead_after: float = DEFAULT_DEAD_AFTER) -> Liveness:
    if entry.state == "stopped":
        return "stopped"
    now = time.time() if now is None else now
    return "dead" if now - entry.heartbeat_ts > dead_after * entry.heartbeat_interval else "alive"


class WorkerRegistry:
    """The bridge's writer. Opening the bucket is lazy, so it can be built before
    NATS answers; every failure is logged and retried at the next beat."""

    def __init__(self, js: nats.js.JetStreamContext, bucket: str, ttl: float) -> None:
        self._js = js
        self.bucket = bucket
        self.ttl = ttl
        self._kv: KeyValue | None = None
        # Serialises puts, so a beat in flight cannot land after `stopped`.
        self._lock = anyio.Lock()
        self._stopped = False

    async def open(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self._js.key_value(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                try:
                    self._kv = await self._js.create_key_value(
                        bucket=self.bucket, history=1, ttl=self.ttl, description="kv-bridge worker registry",
                    )
                except nats.js.errors.BadRequestError:
                    # Another bridge created it first (maybe with another ttl): use theirs.
                    self._kv = await self._js.key_value(self.bucket)
        return self._kv

    async def put(self, entry: WorkerEntry) -> int:
        """Writes the entry with `heartbeat_ts` set to now; returns the revision."""
        kv = await self.open()
        fresh = msgspec.structs.replace(entry, heartbeat_ts=time.time())
        return await kv.put(registry_key(entry.worker), encode_entry(fresh))

    async def heartbeat(self, snapshot: Callable[[], WorkerEntry], interval: float) -> None:
        """Puts `snapshot()` every `interval` seconds until cancelled or `stopped`."""
        while True:
            async with self._lock:
                if self._stopped:
                    return
                try:
                    await self.put(snapshot())
                except Exception as exc:  # NATS away or JetStream busy: the next beat tries again
                    log.warning("registry_put_failed", bucket=self.bucket, error=type(exc).__name__,
                                detail=str(exc)[:200])
                    self._kv = None
            await anyio.sleep(interval)

    async def stopped(self, entry: WorkerEntry) -> None:
        """The last word on exit: readers show `stopped`, not `dead`. Ends the heartbeat."""
        async with self._lock:
            self._stopped = True
            await self.put(msgspec.structs.replace(entry, state="stopped"))


class _RankSeen:
    __slots__ = ("epoch", "last_seq")

    def __init__(self) -> None:
        self.epoch = 0
        self.last_seq: int | None = None


class GroupCatalog:
    """What the registry entry says about groups and seqs, learned from the
    batches on their way to NATS. Per batch: its rank, epoch and seq; per
    message a header read until its group is known, and a payload decoded only
    (and only sometimes) while a group's block size or window is unknown.
    Groups are the pipelines' valid ids (0..MAX_GROUP_ID): the tables keyed by
    them stay bounded whatever a publisher sends."""

    def __init__(self) -> None:
        self._groups: dict[int, GroupInfo] = {}
        self._ranks: dict[int, _RankSeen] = {}
        self._misses: dict[int, int] = {}
        self._decoders: dict[str, Any] = {}
        # subject → the kind its group was fully learned with: nothing more to read.
        self._settled: dict[str, str] = {}

    def observe(self, batch: OutBatch) -> None:
        seen = self._ranks.get(batch.dp_rank)
        if seen is None:
            seen = self._ranks[batch.dp_rank] = _RankSeen()
        if batch.epoch != seen.epoch:
            seen.epoch, seen.last_seq = batch.epoch, None
        if batch.seq >= 0:
            self._saw_seq(seen, batch.seq)
        settled = self._settled
        for out in batch.messages:
            headers = out.headers
            if out.family == "worker":
                # Records tie to a seq only through their header (stop, cleared, resumed start).
                seq_text = headers.get(HDR_SEQ)
                if seq_text is not None:
                    self._saw_seq(seen, int(seq_text))
            elif settled.get(out.subject) != headers.get(HDR_KIND):
                self._learn_group(out.subject, headers, out.payload)

    @staticmethod
    def _saw_seq(seen: _RankSeen, seq: int) -> None:
        if seen.last_seq is None or seq > seen.last_seq:
            seen.last_seq = seq

    def _learn_group(self, subject: str, headers: dict[str, str], payload: bytes) -> None:
        group = int(subject.rpartition(".")[2])
        if not 0 <= group <= MAX_GROUP_ID:
            return
        kind = headers.get(HDR_KIND, UNKNOWN_KIND)
        family = headers.get(HDR_FAMILY, "other")
        info = self._groups.get(group)
        if info is None or (kind != info.kind and kind != UNKNOWN_KIND):
            info = self._groups[group] = GroupInfo(group, kind, family)
        complete = info.block_size > 0 and (info.family != WINDOW or info.sliding_window is not None)
        if complete:
            self._settled[subject] = kind
            return
        misses = self._misses.get(group, 0)
        self._misses[group] = misses + 1
        if misses % _SAMPLE_EVERY == 0:
            self._learn_sizes(info, headers.get(HDR_FORMAT, "msgpack"), payload)

    def _learn_sizes(self, info: GroupInfo, fmt: str, payload: bytes) -> None:
        decoder = self._decoders.get(fmt)
        if decoder is None:
            decoder = self._decoders[fmt] = decoder_for(fmt, _SizesOnly)
        try:
            msg: _SizesOnly = decoder.decode(payload)
        except (msgspec.DecodeError, ValueError):
            return
        for event in msg.events:
            if type(event) is _StoredSizes and not event.placeholder:
                if event.block_size > 0 and not info.block_size:
                    info.block_size = event.block_size
                if event.kv_cache_spec_sliding_window and info.sliding_window is None:
                    info.sliding_window = event.kv_cache_spec_sliding_window

    def entry(
        self,
        *,
        worker: str,
        topic: str,
        subject_prefix: str,
        ranks: Iterable[int],
        started_at: float,
        heartbeat_interval: float,
        model: str = "",
    ) -> WorkerEntry:
        wanted = sorted(set(ranks) | set(self._ranks))
        rank_infos = []
        for rank in wanted:
            seen = self._ranks.get(rank)
            rank_infos.append(RankInfo(rank, seen.epoch, seen.last_seq) if seen else RankInfo(rank))
        groups = [msgspec.structs.replace(g) for _, g in sorted(self._groups.items())]
        return WorkerEntry(
            worker=worker, topic=topic, model=model, subject_prefix=subject_prefix, ranks=rank_infos,
            groups=groups, started_at=started_at, heartbeat_interval=heartbeat_interval,
        )


class CatalogQueue(BatchQueue):
    """The bridge's BatchQueue, showing every batch to a GroupCatalog on its way
    in: every pipeline already writes through it, so nothing else changes.
    Arguments after `catalog` are BatchQueue's own."""

    def __init__(self, catalog: GroupCatalog, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.catalog = catalog

    def put(self, batch: OutBatch) -> None:
        self.catalog.observe(batch)
        super().put(batch)
