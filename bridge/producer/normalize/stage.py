"""One stream's batches, in seq order: decoded and normalized, what was
rejected, dropped or changed counted, a batch that cannot be decoded whole
named by a `malformed` gap."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from bridge.contract import GroupMessage, WorkerRecord
from bridge.producer.decode.decoder import BatchDecodeError, BatchDecoder
from bridge.producer.normalize.normalizer import Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.normalize.redact import PromptRedactor
from bridge.producer.source.frames import Frame
from bridge.producer.telemetry.metrics import Metrics

# seq, vLLM timestamp, the batch's items in order, and whether any of its
# events were malformed (the batch is then named by a gap after its messages).
Deliver = Callable[[int, float, list[GroupMessage | WorkerRecord], bool], None]
Gap = Callable[[int, int, str], None]


class NormalizeStage:
    def __init__(
        self,
        ident: StreamIdentity,
        decoder: BatchDecoder,
        normalizer: Normalizer,
        metrics: Metrics,
        log: structlog.typing.FilteringBoundLogger,
        *,
        deliver: Deliver,
        gap: Gap,
        redact_prompts: bool = False,
    ) -> None:
        self._ident = ident
        self._decoder = decoder
        self._normalizer = normalizer
        self._metrics = metrics
        self._log = log
        self._deliver = deliver
        self._gap = gap
        self._redactor = PromptRedactor() if redact_prompts else None
        # The vLLM timestamp of the last batch decoded: a stop record names it.
        self.last_ts: float | None = None
        self._rank_mismatch_logged = False
        # Reused per batch (emptied after each): one less allocation per batch.
        self._stats = NormalizeStats()

    def restarted(self) -> None:
        """A new publisher process: its groups and their kinds are learned anew."""
        self._normalizer.restarted()

    def timestamp(self, frame: Frame) -> float | None:
        """The batch's vLLM timestamp, if it decodes; nothing is counted."""
        try:
            return self._decoder.decode(frame.payload).ts
        except BatchDecodeError:
            return None

    def frame(self, frame: Frame) -> None:
        """The next batch in seq order."""
        metrics = self._metrics
        metrics.batches_in.inc()
        try:
            batch = self._decoder.decode(frame.payload)
        except BatchDecodeError as exc:
            metrics.malformed_by[exc.reason].inc()
            self._log.warning("malformed_batch", seq=frame.seq, reason=exc.reason, detail=exc.detail)
            self._gap(frame.seq, frame.seq, "malformed")
            return
        dp_rank = self._ident.dp_rank
        if batch.dp_rank is not None and batch.dp_rank != dp_rank and not self._rank_mismatch_logged:
            self._rank_mismatch_logged = True
            self._log.warning("dp_rank_mismatch", configured=dp_rank, batch=batch.dp_rank)
        metrics.events_in.inc(len(batch.events))
        self.last_ts = batch.ts
        stats = self._stats
        items = self._normalizer.normalize(self._ident, frame.seq, batch.ts, batch.events, time.time(), stats)
        malformed = bool(batch.rejected or stats.malformed)
        if malformed:
            self._count_malformed(frame.seq, batch.rejected, stats)
        if stats.dropped:
            for reason, n in stats.dropped.items():
                metrics.dropped_by[reason].inc(n)
        if stats.transformed:
            for what, n in stats.transformed.items():
                metrics.transformed_by[what].inc(n)
        stats.clear()
        if self._redactor is not None:
            self._redactor.redact(items)
        self._deliver(frame.seq, batch.ts, items, malformed)

    def _count_malformed(self, seq: int, rejected: list[tuple[str, str]], stats: NormalizeStats) -> None:
        """Events the decoder or the normalizer rejected: counted by reason, and
        one log line per batch (a hostile frame holds a million of them)."""
        reasons: dict[str, int] = {}
        for reason, _ in rejected:
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, n in stats.malformed.items():
            reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in reasons.items():
            self._metrics.malformed_by[reason].inc(n)
        detail = rejected[0][1] if rejected else stats.malformed_detail
        self._log.warning("malformed_events", seq=seq, rejected=sum(reasons.values()), reasons=reasons,
                          detail=detail)
