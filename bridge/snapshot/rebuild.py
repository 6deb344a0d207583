"""A bridge that resumes a JetStream stream (JetStream mode, after a restart)
rebuilds the residency it knew: per rank, the bucket's latest snapshot, then
the rank's messages the stream stored after it, read with a consumer filtered
to the rank's subjects. What it cannot have (no snapshot and a stream that no
longer starts with the rank's epoch, a stream that dropped messages after the
snapshot, a read that fails) leaves the rank's view partial: its snapshots
say so (`complete=False`) until a record empties the view."""

from __future__ import annotations

import nats.errors
import nats.js
import nats.js.errors
import structlog
from nats.js import api
from nats.js.kv import KeyValue

from bridge.contract import HDR_MSG_ID
from bridge.contract.snapshot import SnapshotHead, SnapshotUnavailable, read_bucket
from bridge.snapshot.keeper import ResidencyKeeper

log = structlog.get_logger("bridge.snapshot")

_FETCH = 256
_FETCH_TIMEOUT_S = 2.0


async def bucket_get(kv: KeyValue, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value


async def rebuild_rank(js: nats.js.JetStreamContext, keeper: ResidencyKeeper, kv: KeyValue | None, *,
                       stream: str, subject_base: str, dp_rank: int) -> SnapshotHead | None:
    """The rank's residency as the stream holds it; returns the bucket head
    it started from (None: none)."""
    worker = keeper.worker
    keeper.forget(dp_rank)
    head = snap = None
    if kv is not None:
        try:
            found = await read_bucket(lambda key: bucket_get(kv, key), worker, dp_rank)
        except (SnapshotUnavailable, nats.errors.Error) as exc:
            log.warning("snapshot_bucket_unreadable", dp_rank=dp_rank, error=str(exc)[:200])
            found = None
        if found is not None:
            head, snap = found
    start = 1
    complete = False
    if snap is not None:
        keeper.index.restore(snap)
        keeper.mark_applied(dp_rank, snap.through, snap.stream_seq)
        start = snap.stream_seq + 1
        complete = snap.complete
    try:
        info = await js.stream_info(stream)
        if info.state.first_seq > start:
            complete = False  # messages after the snapshot (perhaps ours) are gone
        if not complete:
            keeper.index.missing(worker, dp_rank)
        applied = await _replay(js, keeper, stream, f"{subject_base}.>", start, dp_rank)
    except (nats.errors.Error, TimeoutError, OSError) as exc:
        keeper.index.missing(worker, dp_rank)
        log.warning("snapshot_rebuild_failed", dp_rank=dp_rank, stream=stream, error=type(exc).__name__,
                    detail=str(exc)[:200])
        return head
    view = keeper.index.view(worker, dp_rank)
    log.info("snapshot_rebuilt", dp_rank=dp_rank, from_snapshot=snap is not None, replayed=applied,
             partial=view.partial if view is not None else None)
    return head


async def _replay(js: nats.js.JetStreamContext, keeper: ResidencyKeeper, stream: str, subject: str, start: int,
                  dp_rank: int) -> int:
    """The stream's messages on `subject` from `start`, applied in order."""
    # Named for the rank, so a least-privilege user may make just this one (docs/security.md).
    name = f"kvb-rebuild-{subject.rstrip('.>').rpartition('.')[2]}"
    config = api.ConsumerConfig(
        name=name, filter_subject=subject, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
        ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True, num_replicas=1,
    )
    info = await js.add_consumer(stream, config)
    applied = 0
    try:
        remaining = info.num_pending
        if not remaining:
            return 0
        sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
        try:
            while remaining:
                try:
                    msgs = await sub.fetch(_FETCH, timeout=_FETCH_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    break
                for msg in msgs:
                    headers = dict(msg.headers or {})
                    keeper.apply_payload(headers, msg.data)
                    keeper.mark_applied(dp_rank, headers.get(HDR_MSG_ID, ""), msg.metadata.sequence.stream)
                    applied += 1
                    remaining = msg.metadata.num_pending
        finally:
            await sub.unsubscribe()
    finally:
        try:
            await js.delete_consumer(stream, name)
        except Exception as exc:  # it goes by itself after inactive_threshold
            log.debug("rebuild_consumer_delete_failed", consumer=name, error=type(exc).__name__)
    return applied
