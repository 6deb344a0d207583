"""JetStream mode: the latest snapshot of each rank in a key-value bucket
(`--snapshot-bucket`), so a consumer can start from it when the bridge is gone,
and a restarted bridge can rebuild what it knew (bridge.producer.snapshot.rebuild).

Layout and reading are the contract's (bridge.contract.snapshot): the parts of
a snapshot go under one of two slots of the rank's key, then its head; the
next snapshot takes the other slot, so the parts a head names stay there
until the head has moved on. Written every `--snapshot-interval` seconds when
the rank changed, and on exit; sooner once `--snapshot-events` events came
since the last, or as many events as the last one listed hashes if that is
more. A snapshot costs its rank's size to read, encode and put, so writing
one per that many events keeps its cost per event bounded however large the
rank grows (at 50,000 events/s, a rank of 368,308 hashes written every
100,000 events is most of JetStream mode's tail), and a consumer that starts
from it replays no more events than the snapshot listed hashes.
"""

from __future__ import annotations

import time

import anyio
import nats.js
import structlog
from nats.js.kv import KeyValue

from bridge.contract.snapshot import (
    PART_OVERHEAD,
    SNAPSHOT_VERSION,
    RankSnapshot,
    SnapshotHead,
    encode_head,
    encode_part,
    encode_snapshot,
    part_key,
    snapshot_key,
    split,
)
from bridge.producer.sink.kv_bucket import open_bucket as open_kv_bucket
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.telemetry.metrics import Metrics

log = structlog.get_logger("bridge.producer.snapshot")

_SLOTS = ("a", "b")
# A bucket write shares the relay's NATS connection, and the server reads and
# stores one message of a connection at a time: parts of at most this size,
# each put in an idle moment of the relay, hold its batches back by one
# small write at a time, not by a snapshot of megabytes.
PART_BYTES = 128 * 1024


async def open_bucket(js: nats.js.JetStreamContext, bucket: str, *, replicas: int, max_age: float) -> KeyValue:
    """The bucket, made (history 1, entries kept `max_age` s, no rollups,
    no message deletes: bridge.producer.sink.kv_bucket) when missing.

    Made with direct gets allowed: a bridge reads its own keys back (the
    rebuild) with `$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`, which
    a least-privilege user may be allowed key by key; the other way to read
    a key (`$JS.API.STREAM.MSG.GET.KV_<bucket>`) names no key, so such a
    user is not allowed it."""
    return await open_kv_bucket(js, bucket, history=1, ttl=max_age, replicas=replicas,
                                description="kv-bridge residency snapshots, per worker rank")


class SnapshotWriter:
    def __init__(self, keeper: ResidencyKeeper, kv: KeyValue, metrics: Metrics, *, interval: float,
                 every_messages: int, max_payload: int, rewrite_after: float) -> None:
        self._keeper = keeper
        self._kv = kv
        self._metrics = metrics
        self._interval = interval
        self._every = every_messages
        self._max_part = max(1024, min(PART_BYTES, max_payload - PART_OVERHEAD))
        # A snapshot of an unchanged rank is written again after this long,
        # so the bucket's age limit never drops a live rank's.
        self._rewrite_after = rewrite_after
        self._written: dict[int, tuple[int, float]] = {}  # rank → (events applied, when)
        self._listed: dict[int, int] = {}  # rank → hashes its last snapshot listed
        self._slot: dict[int, tuple[str, dict[str, int]]] = {}  # rank → (slot last used, parts per slot)

    def rebind(self, kv: KeyValue) -> None:
        """The bucket as opened on a new NATS connection (the old one was closed)."""
        self._kv = kv

    async def run(self) -> None:
        """Writes due snapshots until cancelled; checks once a second."""
        last_full = time.monotonic()
        while True:
            await anyio.sleep(1.0)
            now = time.monotonic()
            full = now - last_full >= self._interval
            if full:
                last_full = now
            await self.write_due(force_changed=full)

    async def write_due(self, force_changed: bool = False, everything: bool = False) -> int:
        """Writes the ranks that are due (`everything`: all ranks known);
        returns how many were written."""
        keeper = self._keeper
        now = time.monotonic()
        if not (everything or force_changed or self._rewrite_due(now)) and \
                keeper.pending + self._most_overdue() < 0:
            return 0
        await keeper.catch_up_all()
        written = 0
        for rank in keeper.ranks():
            applied = keeper.applied.get(rank, 0)
            last, when = self._written.get(rank, (-1, 0.0))
            changed = applied != last
            due = everything or (changed and (force_changed or applied - max(last, 0) >= self.events_due(rank))) or \
                now - when >= self._rewrite_after
            if not due:
                continue
            taken = await keeper.export(rank)
            if taken is None:
                continue
            try:
                await self.write(*taken)
            except Exception as exc:  # NATS or JetStream away: the next round tries again
                self._metrics.snapshot_writes.labels("failed").inc()
                log.warning("snapshot_write_failed", dp_rank=rank, error=type(exc).__name__, detail=str(exc)[:200])
                continue
            self._written[rank] = (applied, now)
            written += 1
        return written

    def events_due(self, rank: int) -> int:
        """Events after which the rank's snapshot is written again:
        `--snapshot-events`, or the hashes its last snapshot listed if more."""
        return max(self._every, self._listed.get(rank, 0))

    def _most_overdue(self) -> int:
        """Over all ranks, the most events applied since a rank's last
        snapshot beyond its `events_due` (negative: none is due yet)."""
        keeper = self._keeper
        return max((keeper.applied.get(rank, 0) - max(self._written.get(rank, (0, 0.0))[0], 0) - self.events_due(rank)
                    for rank in keeper.applied), default=-self._every)

    def _rewrite_due(self, now: float) -> bool:
        return any(now - when >= self._rewrite_after for _, when in self._written.values())

    async def write(self, snap: RankSnapshot, data: bytes | None = None) -> SnapshotHead:
        """The rank's snapshot (`data`: its encoding, if made already): its
        parts into the slot not in use, then the head."""
        kv = self._kv
        rank = snap.dp_rank
        key = snapshot_key(snap.worker, rank)
        last_slot, counts = self._slot.get(rank, (_SLOTS[1], {}))
        slot = _SLOTS[0] if last_slot == _SLOTS[1] else _SLOTS[1]
        data = encode_snapshot(snap) if data is None else data
        snap_id = f"{snap.epoch}-{int(snap.taken_at * 1000)}-{rank}"
        parts = split(snap, data, snap_id, self._max_part)
        for part in parts:
            await self._keeper.after_relay()
            await kv.put(part_key(key, slot, part.part), encode_part(part))
        head = SnapshotHead(v=SNAPSHOT_VERSION, worker=snap.worker, dp_rank=rank, id=snap_id, slot=slot,
                            parts=len(parts), epoch=snap.epoch, stream_seq=snap.stream_seq, taken_at=snap.taken_at,
                            bytes=len(data))
        await kv.put(key, encode_head(head))
        # Parts of an older, larger snapshot in this slot name nothing now. A
        # delete marker, not a purge: a purge is a rollup, which the bucket
        # refuses (with history 1 the marker replaces the part all the same).
        for n in range(len(parts), counts.get(slot, 0)):
            try:
                await kv.delete(part_key(key, slot, n))
            except Exception as exc:  # left behind: a reader never reads past the head's count
                log.debug("snapshot_part_delete_failed", key=part_key(key, slot, n), error=type(exc).__name__)
        counts = {**counts, slot: len(parts)}
        self._slot[rank] = (slot, counts)
        self._listed[rank] = listed(snap)
        self._metrics.snapshot_writes.labels("written").inc()
        self._metrics.snapshot_bytes.set(len(data))
        log.info("snapshot_written", dp_rank=rank, stream_seq=snap.stream_seq, parts=len(parts), bytes=len(data),
                 through=snap.through)
        return head

    def resume_slot(self, rank: int, head: SnapshotHead | None) -> None:
        """After a restart: the slot the bucket's head uses is not written next."""
        if head is not None:
            self._slot[rank] = (head.slot, {head.slot: head.parts})


def listed(snap: RankSnapshot) -> int:
    """Hashes a snapshot lists, over its groups, tiers and layers."""
    return sum(len(t.trusted) + len(t.suspect) + len(t.placeholders) for g in snap.groups for t in g.tiers)
