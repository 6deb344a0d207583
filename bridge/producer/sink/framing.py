"""One stream's normalized items and worker records → the NATS messages that
carry them (`Outgoing`), batched per vLLM seq for the queue."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog

from bridge import __version__
from bridge.contract import (
    HDR_MSG_ID,
    SCHEMA_VERSION,
    BlockStored,
    GroupEvent,
    GroupMessage,
    RecordType,
    WorkerRecord,
    worker_token,
)
from bridge.contract.msgid import record_at, record_id, stream_base
from bridge.producer.normalize.normalizer import StreamIdentity
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.queue import OutBatch
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.telemetry.metrics import Metrics


def _never() -> bool:
    return False


class Framing:
    """Messages for stream `stream` (the queue's index of it), under `ident`'s
    current epoch. `max_payload` is the server's limit, read per batch: it is
    known only once connected and may change on reconnect. `keep_bodies`,
    asked once a batch: whether its messages carry the structs they encode
    (`Outgoing.body`), for the snapshot keeper."""

    def __init__(
        self,
        stream: int,
        ident: StreamIdentity,
        subjects: SubjectBook,
        encoder: MessageEncoder,
        max_payload: Callable[[], int],
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        clock: Callable[[], float] = time.time,
        keep_bodies: Callable[[], bool] | None = None,
    ) -> None:
        self._stream = stream
        self._ident = ident
        self._subjects = subjects
        self._encoder = encoder
        self._max_payload = max_payload
        self._metrics = metrics
        self._log = log
        self._clock = clock
        self._keep_bodies = keep_bodies or _never
        self._token = worker_token(ident.worker, ident.dp_rank)
        self._base_epoch = -1
        self._base = ""
        # (seq, Nats-Msg-Id): the batch the stream holds only in part, and its last stored message.
        self._partial: tuple[int, str] | None = None

    def resume_inside(self, seq: int, last_id: str) -> None:
        """Batch `seq` is in the stream up to message `last_id`: only the rest of it is owed."""
        self._partial = (seq, last_id)

    def restarted(self) -> None:
        """A new publisher process: its batches owe nothing to the old one's."""
        self._partial = None

    def record(self, type_: RecordType, *, seq: int | None = None, gap: tuple[int, int] | None = None,
               reason: str | None = None, epoch: int | None = None, batch_ts: float | None = None) -> OutBatch:
        ident = self._ident
        rec = WorkerRecord(
            v=SCHEMA_VERSION, worker=ident.worker, dp_rank=ident.dp_rank,
            epoch=ident.epoch if epoch is None else epoch, type=type_, ts=self._clock(), seq=seq,
            gap_from=gap[0] if gap else None, gap_to=gap[1] if gap else None, reason=reason,
            topic=ident.topic, bridge_version=__version__, batch_ts=batch_ts,
        )
        # A start or a stop is one bridge process's own: named by its time,
        # not its seq. A bridge that resumes the epoch and stops again with
        # no batch between has the seq of its predecessor's start or stop,
        # and the stream's duplicate window would drop its record as a copy.
        at = record_at(None if type_ in ("start", "stop") else seq, rec.ts, gap)
        msg_id = record_id(stream_base(self._token, ident.dp_rank, rec.epoch), at, type_)
        out = self._encoder.record(rec, self._subjects, msg_id, self._keep_bodies())
        return OutBatch(self._stream, rec.epoch, -1, rec.ts, [out], ident.dp_rank)

    def batch(self, seq: int, ts: float, items: list[GroupMessage | WorkerRecord]) -> tuple[OutBatch, bool]:
        """Batch `seq`'s messages in order, and whether any of its groups could
        not be sent at all (the caller names the seq by a gap)."""
        epoch = self._ident.epoch
        if epoch != self._base_epoch:
            self._base_epoch = epoch
            self._base = stream_base(self._token, self._ident.dp_rank, epoch)
        base = self._base
        limit = self._max_payload()
        keep = self._keep_bodies()
        out: list[Outgoing] = []
        clears = 0
        unpublishable = False
        for item in items:
            if type(item) is GroupMessage:
                encoded = self._group(item, base, limit, keep)
                if encoded is None:
                    unpublishable = True
                else:
                    out.extend(encoded)
            else:
                clears += 1
                msg_id = record_id(base, str(seq), f"cleared{clears}")
                out.append(self._encoder.record(item, self._subjects, msg_id, keep))  # type: ignore[arg-type]
        if self._partial is not None and self._partial[0] == seq:
            out = _after_last_stored(out, self._partial[1])
            self._partial = None
        return OutBatch(self._stream, epoch, seq, ts, out, self._ident.dp_rank), unpublishable

    def _group(self, msg: GroupMessage, base: str, limit: int, keep: bool) -> list[Outgoing] | None:
        """The group's slice as NATS messages: several if it exceeds the
        server's max_payload (events split in order, `chunk`/`chunks` say so),
        none (counted, logged) if it cannot be sent at all."""
        try:
            out = self._encoder.group(msg, self._subjects, base, keep)
        except (TypeError, ValueError, OverflowError) as exc:
            # JSON cannot carry what msgpack can (Ext values, non-string keys)
            # in vLLM's free-form extra_keys: forward the events without them.
            for event in msg.events:
                if isinstance(event, BlockStored):
                    event.extra_keys = None
            self._metrics.transformed_by["extra_keys_dropped"].inc()
            self._log.warning("extra_keys_dropped", seq=msg.seq, group=msg.group, error=str(exc)[:200])
            try:
                out = self._encoder.group(msg, self._subjects, base, keep)
            except (TypeError, ValueError, OverflowError) as exc2:
                self._metrics.malformed_by["unencodable"].inc()
                self._log.warning("unencodable", seq=msg.seq, group=msg.group, error=str(exc2)[:200])
                return None
        size = out.nbytes
        if size <= limit:
            return [out]
        # A slice can encode to several times its frame (tiny array events
        # become full maps): only one encoding of it is held at a time.
        del out
        pieces = self._split_events(msg, base, limit, size, len(msg.events))
        if pieces is None:
            self._metrics.malformed_by["too_large_for_nats"].inc()
            self._log.warning("too_large_for_nats", seq=msg.seq, group=msg.group, bytes=size, max_payload=limit)
            return None
        self._metrics.transformed_by["split"].inc()
        return [
            self._encoder.group(
                msgspec.structs.replace(msg, events=events, chunk=i, chunks=len(pieces)), self._subjects, base, keep
            )
            for i, events in enumerate(pieces)
        ]

    def _split_events(self, msg: GroupMessage, base: str, limit: int, size: int,
                      chunks: int) -> list[list[GroupEvent]] | None:
        """The slice's events in order, cut into as many even pieces as its
        encoded `size` needs to fit `limit` (with room to spare), any piece that
        still does not fit cut again; None if one event alone does not fit.
        Pieces are measured with `chunks` (at least their final count) as both
        chunk numbers, so their final encoding is no larger."""
        events = msg.events
        if len(events) < 2:
            return None
        n = min(len(events), max(2, -(-size * 10 // (limit * 9))))
        step = -(-len(events) // n)
        pieces: list[list[GroupEvent]] = []
        for start in range(0, len(events), step):
            piece = msgspec.structs.replace(msg, events=events[start : start + step], chunk=chunks, chunks=chunks)
            piece_size = self._encoder.group(piece, self._subjects, base).nbytes
            if piece_size <= limit:
                pieces.append(piece.events)
                continue
            smaller = self._split_events(piece, base, limit, piece_size, chunks)
            if smaller is None:
                return None
            pieces.extend(smaller)
        return pieces


def _after_last_stored(out: list[Outgoing], last_id: str) -> list[Outgoing]:
    """A bridge that died inside a batch: what follows the last message the
    stream holds is what is still owed."""
    for i, msg in enumerate(out):
        if msg.headers.get(HDR_MSG_ID) == last_id:
            return out[i + 1 :]
    return out
