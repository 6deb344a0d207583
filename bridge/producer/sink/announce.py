"""One stream's worker records on their way to the queue. A gap is counted by
reason and logged here and nowhere else, whoever finds it: continuity (lost
batches), the normalize stage (malformed), framing (unpublishable), the queue
(overflow) or the publisher (refused, reordered)."""

from __future__ import annotations

import structlog

from bridge.contract import RecordType
from bridge.producer.sink.framing import Framing
from bridge.producer.sink.queue import BatchQueue, OutBatch
from bridge.producer.telemetry.metrics import Metrics


class Announcer:
    def __init__(self, framing: Framing, queue: BatchQueue, metrics: Metrics,
                 log: structlog.typing.FilteringBoundLogger) -> None:
        self._framing = framing
        self._queue = queue
        self._metrics = metrics
        self._log = log

    def record(self, type_: RecordType, *, seq: int | None = None, gap: tuple[int, int] | None = None,
               reason: str | None = None, epoch: int | None = None, batch_ts: float | None = None) -> OutBatch:
        """A record's batch, not queued (the caller decides where it goes)."""
        return self._framing.record(type_, seq=seq, gap=gap, reason=reason, epoch=epoch, batch_ts=batch_ts)

    def put(self, type_: RecordType, *, seq: int | None = None, reason: str | None = None) -> None:
        self._queue.put(self.record(type_, seq=seq, reason=reason))

    def gap_record(self, first: int, last: int, reason: str, epoch: int | None = None) -> OutBatch:
        """Batches `first..last` named lost (`epoch`: theirs, when not the current one)."""
        self._metrics.gaps_by[reason].inc()
        self._metrics.gap_batches.inc(last - first + 1)
        if epoch is None:
            self._log.warning("gap", first=first, last=last, reason=reason)
        else:
            self._log.warning("gap", first=first, last=last, reason=reason, epoch=epoch)
        return self.record("gap", gap=(first, last), reason=reason, epoch=epoch)

    def gap(self, first: int, last: int, reason: str, epoch: int | None = None) -> None:
        self._queue.put(self.gap_record(first, last, reason, epoch))
