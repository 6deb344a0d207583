"""A bridge that resumes a JetStream stream (JetStream mode, after a restart)
rebuilds the residency it knew: per rank, the bucket's latest snapshot, then
the rank's messages the stream stored after it, read with a consumer filtered
to the rank's subjects. What it cannot have (no snapshot and a stream that no
longer starts with the rank's epoch, a stream that dropped messages after the
snapshot, a read that fails) leaves the rank's view partial: its snapshots
say so (`complete=False`) until a record empties the view.

What the stream holds is judged from its state (bridge.contract.holdings):
its first sequence and the messages deleted from its middle (a per-subject
limit, a delete), after the snapshot and after any record that resets the
view. Messages read back are taken as the rank's only when their subject says
so (bridge.contract.identity): one whose payload names another worker, rank
or group is refused, counted (`ResidencyKeeper.refused`) and logged once."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import nats.errors
import nats.js
import nats.js.errors
import structlog

from bridge.contract import DEFAULT_FORMAT, FORMATS, HDR_FORMAT, HDR_MSG_ID, HDR_RECORD, WorkerRecord, decoder_for
from bridge.contract.holdings import StreamHoldings
from bridge.contract.identity import Refusal, check_key, reply_copy, subject_origin
from bridge.contract.snapshot import (
    RankSnapshot,
    SnapshotHead,
    SnapshotUnavailable,
    read_bucket,
    snapshot_key,
    stored_value,
)
from bridge.contract.subjects import worker_token
from bridge.producer.sink.rank_reader import StoredMessage, rank_consumer, read_rank, read_stored
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.runtime.stream_state import stream_holdings

log = structlog.get_logger("bridge.producer.snapshot")


async def own_bucket_keys(js: nats.js.JetStreamContext, bucket: str, worker: str,
                          dp_rank: int) -> dict[str, StoredMessage]:
    """The rank's snapshot head and parts as the bucket stores them, by key.
    Read with the rank's consumer on the bucket's stream, so with their
    stored headers: a copy someone's read left on a key is told apart
    (`stored_value`), which a direct get's answer cannot show. The consumer
    is named and filtered in the API subject, once for the head's key and
    once for its parts', so a least-privilege user may make just these."""
    key = snapshot_key(worker, dp_rank)
    name = rank_consumer(worker_token(worker, dp_rank))
    root = f"$KV.{bucket}."
    values: dict[str, StoredMessage] = {}

    def keep(batch: list[StoredMessage]) -> bool:
        for msg in batch:
            values[msg.subject.removeprefix(root)] = msg
        return True

    for subject in (f"{root}{key}", f"{root}{key}.>"):
        await read_stored(js, f"KV_{bucket}", name, subject, keep)
    return values


async def bucket_value(values: Mapping[str, StoredMessage], key: str) -> bytes | None:
    """`read_bucket`'s get over `own_bucket_keys`."""
    msg = values.get(key)
    return None if msg is None else stored_value(key, msg.headers, msg.data)


async def rebuild_rank(js: nats.js.JetStreamContext, keeper: ResidencyKeeper, bucket: str | None, *,
                       stream: str, subject_base: str, dp_rank: int) -> SnapshotHead | None:
    """The rank's residency as the stream holds it, from the snapshot
    `bucket`'s latest (None: no bucket); returns the head it started from
    (None: none)."""
    worker = keeper.worker
    keeper.forget(dp_rank)
    head = snap = None
    if bucket is not None:
        try:
            values = await own_bucket_keys(js, bucket, worker, dp_rank)
            found = await read_bucket(lambda key: bucket_value(values, key), worker, dp_rank)
        except (SnapshotUnavailable, nats.errors.Error, TimeoutError, OSError) as exc:
            log.warning("snapshot_bucket_unreadable", dp_rank=dp_rank, error=str(exc)[:200])
            found = None
        if found is not None:
            key = snapshot_key(worker, dp_rank)
            why = check_key(key, found[0].worker, found[0].dp_rank) or check_key(key, found[1].worker,
                                                                                 found[1].dp_rank)
            if why is None:
                head, snap = found
            else:
                log.warning("snapshot_bucket_refused", dp_rank=dp_rank, key=key, reason=why.value,
                            says_worker=found[1].worker[:200], says_dp_rank=found[1].dp_rank)
    try:
        holdings = await stream_holdings(js, stream)
    except (nats.errors.Error, TimeoutError, OSError) as exc:
        restore_rank(keeper, dp_rank, snap, None)
        _failed(dp_rank, stream, exc)
        return head
    start = restore_rank(keeper, dp_rank, snap, holdings)
    try:
        applied = await _replay(js, keeper, stream, subject_base, start, dp_rank, holdings)
    except (nats.errors.Error, TimeoutError, OSError) as exc:
        keeper.index.missing(worker, dp_rank)
        _failed(dp_rank, stream, exc)
        return head
    view = keeper.index.view(worker, dp_rank)
    log.info("snapshot_rebuilt", dp_rank=dp_rank, from_snapshot=snap is not None, replayed=applied,
             partial=view.partial if view is not None else None)
    return head


def restore_rank(keeper: ResidencyKeeper, dp_rank: int, snap: RankSnapshot | None,
                 holdings: StreamHoldings | int | None) -> int:
    """The pure start of a rebuild: the rank's view replaced by the bucket's
    snapshot `snap` (None: none), and marked partial unless the snapshot is
    complete and the stream (`holdings`: its state; an int: its first
    sequence alone; None: unknown) still holds every message after it.
    Returns the stream sequence to replay the rank's messages from
    (`replayed` applies each)."""
    if type(holdings) is int:
        holdings = StreamHoldings(holdings, 1 << 62)
    keeper.forget(dp_rank)
    start = 1
    complete = False
    if snap is not None:
        keeper.index.restore(snap)
        keeper.mark_applied(dp_rank, snap.through, snap.stream_seq)
        start = snap.stream_seq + 1
        complete = snap.complete
    if not isinstance(holdings, StreamHoldings) or not holdings.holds_after(start - 1):
        complete = False  # messages after the snapshot (perhaps ours) are gone, or may be
    if not complete:
        keeper.index.missing(keeper.worker, dp_rank)
    return start


_RECORDS = {fmt: decoder_for(fmt, WorkerRecord) for fmt in FORMATS}


def replayed(keeper: ResidencyKeeper, dp_rank: int, headers: dict[str, str], data: bytes, stream_seq: int,
             subject: str, holdings: StreamHoldings | None = None) -> bool:
    """One of the rank's messages the stream holds after the snapshot, in
    stream order, as read from `subject`; False when refused (its payload
    speaks for another worker, rank or group). A record that resets the view
    leaves it partial when the stream (`holdings`) no longer holds every
    message after it."""
    # A reply-subject copy (bridge.contract.identity) is not the bridge's own message, whatever it says.
    why = Refusal.REPLY_COPY if reply_copy(headers) else None
    if why is not None:
        keeper.refused[why] += 1
    else:
        why = keeper.apply_payload(headers, data, origin=subject_origin(subject))
    if why is not None:
        if keeper.refused[why] == 1:
            log.warning("message_refused", subject=subject[:300], reason=why.value, dp_rank=dp_rank,
                        note="identity comes from the subject; logged once per reason")
        return False
    keeper.mark_applied(dp_rank, headers.get(HDR_MSG_ID, ""), stream_seq)
    if holdings is not None and HDR_RECORD in headers and not holdings.holds_after(stream_seq):
        try:
            rec = _RECORDS.get(headers.get(HDR_FORMAT, DEFAULT_FORMAT), _RECORDS[DEFAULT_FORMAT]).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return True
        if rec.type == "restart" or (rec.type == "start" and rec.reason != "resumed"):
            keeper.index.missing(keeper.worker, dp_rank)
    return True


def _failed(dp_rank: int, stream: str, exc: BaseException) -> None:
    log.warning("snapshot_rebuild_failed", dp_rank=dp_rank, stream=stream, error=type(exc).__name__,
                detail=str(exc)[:200])


async def _replay(js: nats.js.JetStreamContext, keeper: ResidencyKeeper, stream: str, subject_base: str, start: int,
                  dp_rank: int, holdings: StreamHoldings) -> int:
    """The rank's messages the stream holds from `start`, applied in order."""

    def apply(batch: list[StoredMessage]) -> bool:
        for msg in batch:
            replayed(keeper, dp_rank, msg.headers, msg.data, msg.seq, msg.subject, holdings)
        return True

    return await read_rank(js, stream, subject_base, start, apply)
