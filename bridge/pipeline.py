"""One vLLM publisher (endpoint × rank): ZMQ frames → seq checks and replay →
decode → normalize → encoded batches on the sink's queue."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.abc
import msgspec
import structlog
import zmq

from bridge import __version__
from bridge.contract import HDR_MSG_ID, SCHEMA_VERSION, GroupEvent, GroupMessage, RecordType, WorkerRecord
from bridge.decode.decoder import BatchDecodeError, BatchDecoder
from bridge.decode.wire import BlockStored
from bridge.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.observe.metrics import Metrics
from bridge.sink.encode import MessageEncoder, Outgoing
from bridge.sink.jetstream import ResumePoint
from bridge.sink.queue import BatchQueue, LostRange, OutBatch
from bridge.sink.subjects import SubjectBook, worker_token
from bridge.source.frames import Frame, FrameError, parse_pub, socket_limit
from bridge.source.replay import ReplayClient
from bridge.source.sequencer import SeqTracker, Verdict
from bridge.source.subscriber import Subscriber

# A sink that took no batch for this long is stalled, not slow.
_STALLED_AFTER_S = 0.5


def new_epoch(previous: int = 0) -> int:
    """Epochs are wall-clock milliseconds, so they also differ across bridge
    restarts; strictly rising even if the clock does not."""
    return max(int(time.time() * 1000), previous + 1)


class StreamPlan:
    """What one pipeline needs to know about its publisher."""

    def __init__(self, index: int, dp_rank: int, endpoint: str, replay_endpoint: str | None) -> None:
        self.index = index
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint


class StreamPipeline:
    def __init__(
        self,
        plan: StreamPlan,
        *,
        worker: str,
        topic: str,
        prefix: str,
        pinned_kinds: dict[int, str],
        keep_placeholders: bool,
        max_frame_bytes: int,
        rcvhwm: int,
        coalesce_s: float,
        replay_timeout: float,
        idle_probe_s: float,
        max_payload: Callable[[], int],
        nats_up: Callable[[], bool],
        ctx: zmq.Context[zmq.Socket[bytes]],
        queue: BatchQueue,
        encoder: MessageEncoder,
        metrics: Metrics,
    ) -> None:
        self.plan = plan
        self._topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._max_frame_bytes = max_frame_bytes
        self._rcvhwm = rcvhwm
        self._coalesce_s = coalesce_s
        self._ctx = ctx
        self._queue = queue
        self._encoder = encoder
        self._metrics = metrics
        self._decoder = BatchDecoder(relay=encoder.format == "msgpack")
        self._normalizer = Normalizer(KindBook(pinned_kinds), keep_placeholders)
        self.subjects = SubjectBook(prefix, worker, plan.dp_rank)
        self._token = worker_token(worker, plan.dp_rank)
        self.ident = StreamIdentity(worker=worker, dp_rank=plan.dp_rank, topic=topic, epoch=new_epoch())
        self.tracker = SeqTracker()
        self._replay = (
            ReplayClient(ctx, plan.replay_endpoint, replay_timeout, max_frame_bytes, self._bad_frame)
            if plan.replay_endpoint
            else None
        )
        self._log = structlog.get_logger("bridge.stream").bind(
            worker=worker, dp_rank=plan.dp_rank, endpoint=plan.endpoint
        )
        self._rank_mismatch_logged = False
        self._last_ts: float | None = None
        # Set by resume(): where the stream left off, until replay or the first
        # live batch shows whether vLLM is still the same process.
        self._resume: ResumePoint | None = None
        self._unverified = False
        # Healing and idle probes both read replay and emit; one at a time.
        self._replay_lock = anyio.Lock()
        self._idle_probe_s = idle_probe_s
        self._max_payload = max_payload
        self._nats_up = nats_up
        # (seq, Nats-Msg-Id): the batch the stream holds only in part, and its last stored message.
        self._resume_partial: tuple[int, str] | None = None
        self._last_live = time.monotonic()
        # Reused per batch (emptied after each): one less allocation per batch.
        self._stats = NormalizeStats()
        self._msg_id_epoch = -1
        self._msg_id_base = ""

    # -- records ---------------------------------------------------------

    def record(self, type_: RecordType, *, seq: int | None = None, gap: tuple[int, int] | None = None,
               reason: str | None = None, epoch: int | None = None, batch_ts: float | None = None) -> OutBatch:
        rec = WorkerRecord(
            v=SCHEMA_VERSION, worker=self.ident.worker, dp_rank=self.ident.dp_rank,
            epoch=self.ident.epoch if epoch is None else epoch, type=type_, ts=time.time(), seq=seq,
            gap_from=gap[0] if gap else None, gap_to=gap[1] if gap else None, reason=reason,
            topic=self._topic, bridge_version=__version__, batch_ts=batch_ts,
        )
        suffix = f"{seq}" if seq is not None else f"t{int(rec.ts * 1000)}"
        if gap:
            suffix = f"{gap[0]}-{gap[1]}"
        msg_id = f"{self._token}:{self.ident.dp_rank}:{rec.epoch}:{suffix}:worker:{type_}"
        out = self._encoder.record(rec, self.subjects, msg_id)
        return OutBatch(self.plan.index, rec.epoch, -1, rec.ts, [out], self.ident.dp_rank)

    def gap_batch(self, lost: LostRange) -> OutBatch:
        self._metrics.gaps_by["queue_overflow"].inc()
        self._metrics.gap_batches.inc(lost.last - lost.first + 1)
        self._log.warning("gap", first=lost.first, last=lost.last, reason="queue_overflow")
        return self.record("gap", gap=(lost.first, lost.last), reason="queue_overflow", epoch=lost.epoch)

    def refused(self, batch: OutBatch) -> None:
        """The stream refused part of `batch` for good: a gap names it. The
        record may follow later batches; its epoch is the batch's."""
        self._announce_gap(batch.seq, batch.seq, "refused", epoch=batch.epoch)

    def _announce_gap(self, first: int, last: int, reason: str, epoch: int | None = None) -> None:
        if last < first:
            return
        self._metrics.gaps_by[reason].inc()
        self._metrics.gap_batches.inc(last - first + 1)
        self._log.warning("gap", first=first, last=last, reason=reason)
        self._queue.put(self.record("gap", gap=(first, last), reason=reason, epoch=epoch))

    def stop_record(self) -> OutBatch:
        return self.record("stop", seq=self.tracker.last_emitted, batch_ts=self._last_ts)

    # -- resume (JetStream) ----------------------------------------------

    def resume(self, point: ResumePoint) -> None:
        """Continue the stream's epoch after the last batch it wholly holds."""
        self.ident.epoch = point.epoch
        self.tracker.last_emitted = point.done_through
        self._last_ts = point.check_ts
        self._resume = point
        if point.partial_msg_id is not None:
            self._resume_partial = (point.done_through + 1, point.partial_msg_id)
        self._log.info("resuming", epoch=point.epoch, done_through=point.done_through,
                       partial=point.partial_msg_id is not None)

    async def _verify_resume(self, point: ResumePoint) -> None:
        """Same vLLM process as before the bridge stopped? Replay from the batch
        whose timestamp the stream knows: the same seq with the same timestamp
        (or, if it is no longer buffered, a later batch with a later one) means
        yes; anything else is a new process. Without such a batch there is no
        evidence, and what replay holds after `done_through` is taken as ours."""
        if self._replay is None:
            self._unverified = True
            return
        checking = point.check_seq is not None and point.check_ts is not None
        start = point.check_seq if checking else point.done_through + 1
        result = await self._replay.fetch(max(start or 0, 0))
        self._metrics.replays.labels("complete" if result.complete else "timeout").inc()
        frames = sorted(result.frames, key=lambda f: f.seq)
        if not frames:
            if not result.complete:
                self._unverified = True
            elif checking:
                await self._restart_and_replay()
            return
        continued = True
        if checking:
            first_ts = self._peek_ts(frames[0])
            if frames[0].seq == point.check_seq:
                continued = first_ts == point.check_ts
            else:
                continued = first_ts is not None and first_ts >= point.check_ts  # type: ignore[operator]
        if not continued:
            self._resume_partial = None
            await self._restart_and_replay()
            return
        self._log.info("resume_verified", epoch=self.ident.epoch, done_through=point.done_through,
                       replayed=len(frames))
        self._emit_replayed(frames, until=None)

    def _peek_ts(self, frame: Frame) -> float | None:
        try:
            return self._decoder.decode(frame.payload).ts
        except BatchDecodeError:
            return None

    async def _restart_and_replay(self) -> None:
        self._restart(None)
        assert self._replay is not None
        result = await self._replay.fetch(0)
        self._metrics.replays.labels("complete" if result.complete else "timeout").inc()
        self._emit_replayed(sorted(result.frames, key=lambda f: f.seq), until=None)

    # -- the loop --------------------------------------------------------

    async def run(self, on_subscribed: Callable[[], None]) -> None:
        sub = Subscriber(self._ctx, self.plan.endpoint, self._topic, self._rcvhwm, self._coalesce_s,
                         socket_limit(self._max_frame_bytes))
        self._log.info("zmq_subscribed", replay=self.plan.replay_endpoint, topic=self._topic)
        self._queue.put(self.record("start", reason="fresh" if self._resume is None else "resumed",
                                    seq=None if self._resume is None else self._resume.done_through))
        if self._resume is not None:
            await self._verify_resume(self._resume)
        on_subscribed()
        try:
            async with anyio.create_task_group() as tg:
                if self._replay is not None and self._idle_probe_s > 0:
                    tg.start_soon(self._probe_when_idle)
                queue = self._queue
                take = self._take_live
                async for messages in sub.batches():
                    self._last_live = time.monotonic()
                    for parts in messages:
                        # In-order batches are handled without an await; only
                        # gaps, restarts and resume checks need replay.
                        pending = take(parts)
                        if pending is not None:
                            await self._on_out_of_order(*pending)
                        if queue.full():
                            await self._backpressure()
        finally:
            sub.close()

    async def _backpressure(self) -> None:
        """A full queue while NATS is up means a burst, not an outage: wait for
        the sink (ZMQ buffers meanwhile, and replay heals what its high-water
        mark drops) instead of shedding batches NATS would take. While NATS is
        away or stalled (no batch taken for a while: a frozen server keeps its
        TCP connection) the queue's drop-oldest policy bounds memory instead."""
        queue = self._queue
        while queue.full() and self._nats_up() and queue.progressing(_STALLED_AFTER_S):
            await queue.wait_for_room(0.1)

    async def _probe_when_idle(self) -> None:
        """A PUB stream cannot show that its last batches were lost until
        another batch comes. While the stream is quiet, ask replay now and then
        for anything after the last seq: it heals a lost tail (and batches sent
        before the SUB connected) without waiting for the next batch."""
        assert self._replay is not None
        while True:
            await anyio.sleep(self._idle_probe_s)
            if time.monotonic() - self._last_live < self._idle_probe_s:
                continue
            async with self._replay_lock:
                result = await self._replay.fetch(self.tracker.next_wanted())
                self._metrics.replays.labels("probe" if result.complete else "timeout").inc()
                self._emit_replayed(sorted(result.frames, key=lambda f: f.seq), until=None)

    def _take_live(self, parts: list[bytes]) -> tuple[Frame, Verdict | None] | None:
        """Handles a live message that needs no replay; otherwise returns it
        with its verdict (None: the first one after an unverified resume)."""
        try:
            frame = parse_pub(parts, self._max_frame_bytes)
        except FrameError as exc:
            self._bad_frame(exc)
            return None
        if self._topic_bytes and frame.topic != self._topic_bytes:
            self._metrics.dropped_by["foreign_topic"].inc()
            return None
        if self._unverified:
            return frame, None
        verdict = self.tracker.classify_live(frame.seq)
        if self._in_order(frame, verdict):
            return None
        return frame, verdict

    def _in_order(self, frame: Frame, verdict: Verdict) -> bool:
        """Handles the verdicts that need no replay: the next batch, or one already had."""
        if verdict is Verdict.ACCEPT:
            self._emit(frame)
            return True
        if verdict is Verdict.DUPLICATE:
            self._metrics.dropped_by["duplicate"].inc()
            return True
        return False

    async def _on_out_of_order(self, frame: Frame, verdict: Verdict | None) -> None:
        if verdict is None:
            # Resumed without a replay answer: a continuing process is already
            # past the stream's last seq, a new one is not.
            self._unverified = False
            if frame.seq <= self.tracker.last_emitted:
                self._restart(frame.seq)
                await self._heal(frame)
                return
            verdict = self.tracker.classify_live(frame.seq)
            if self._in_order(frame, verdict):
                return
        if verdict is Verdict.GAP:
            await self._heal(frame)
            return
        self._restart(frame.seq)
        if frame.seq == self.tracker.next_wanted():
            self._emit(frame)
        else:
            await self._heal(frame)

    def _restart(self, seq: int | None) -> None:
        previous = self.tracker.last_emitted
        self.ident.epoch = new_epoch(self.ident.epoch)
        self._normalizer.kinds.forget()
        self.tracker.restart()
        self._resume_partial = None
        self._metrics.restarts.inc()
        self._log.warning("publisher_restart", previous_seq=previous, seq=seq, epoch=self.ident.epoch)
        self._queue.put(self.record("restart", seq=seq))

    async def _heal(self, live: Frame) -> None:
        async with self._replay_lock:
            if self.tracker.wants(live.seq):
                await self._heal_locked(live)
            else:
                self._metrics.dropped_by["duplicate"].inc()

    async def _heal_locked(self, live: Frame) -> None:
        """Fetch what the live stream skipped; announce what replay cannot give."""
        want = self.tracker.next_wanted()
        if self._replay is None:
            self._announce_gap(want, live.seq - 1, "no_replay_endpoint")
        else:
            result = await self._replay.fetch(want, stop_after=live.seq)
            self._metrics.replays.labels("complete" if result.complete else "timeout").inc()
            self._emit_replayed(sorted(result.frames, key=lambda f: f.seq), until=live.seq)
            reason = "replay_incomplete" if result.complete else "replay_timeout"
            self._announce_gap(self.tracker.next_wanted(), live.seq - 1, reason)
        self._emit(live)

    def _emit_replayed(self, frames: list[Frame], until: int | None) -> None:
        """Replayed batches in seq order, each once; holes among them are gaps."""
        for frame in frames:
            if until is not None and frame.seq >= until:
                break
            if not self.tracker.wants(frame.seq):
                continue
            if self._topic_bytes and frame.topic not in (self._topic_bytes, b""):
                continue
            if frame.seq > self.tracker.next_wanted():
                self._announce_gap(self.tracker.next_wanted(), frame.seq - 1, "replay_incomplete")
            self._metrics.replayed_batches.inc()
            self._emit(frame)

    def _emit(self, frame: Frame) -> None:
        """One batch in sequence: its messages on the queue, and a gap record
        after them if what it said did not all come through."""
        metrics = self._metrics
        metrics.batches_in.inc()
        self.tracker.emitted(frame.seq)
        try:
            batch = self._decoder.decode(frame.payload)
        except BatchDecodeError as exc:
            metrics.malformed.labels(exc.reason).inc()
            self._log.warning("malformed_batch", seq=frame.seq, reason=exc.reason, detail=exc.detail)
            self._announce_gap(frame.seq, frame.seq, "malformed")
            return
        if batch.dp_rank is not None and batch.dp_rank != self.ident.dp_rank and not self._rank_mismatch_logged:
            self._rank_mismatch_logged = True
            self._log.warning("dp_rank_mismatch", configured=self.ident.dp_rank, batch=batch.dp_rank)
        metrics.events_in.inc(len(batch.events))
        self._last_ts = batch.ts
        stats = self._stats
        items = self._normalizer.normalize(self.ident, frame.seq, batch.ts, batch.events, time.time(), stats)
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
        epoch = self.ident.epoch
        if epoch != self._msg_id_epoch:
            self._msg_id_epoch = epoch
            self._msg_id_base = f"{self._token}:{self.ident.dp_rank}:{epoch}"
        msg_id_base = self._msg_id_base
        limit = self._max_payload()
        out: list[Outgoing] = []
        clears = 0
        unpublishable = False
        for item in items:
            if type(item) is GroupMessage:
                encoded = self._encode_group(item, msg_id_base, limit)
                if encoded is None:
                    unpublishable = True
                else:
                    out.extend(encoded)
            else:
                clears += 1
                msg_id = f"{msg_id_base}:{frame.seq}:worker:cleared{clears}"
                out.append(self._encoder.record(item, self.subjects, msg_id))  # type: ignore[arg-type]
        if self._resume_partial is not None and self._resume_partial[0] == frame.seq:
            out = self._after_last_stored(out, self._resume_partial[1])
            self._resume_partial = None
        self._queue.put(OutBatch(self.plan.index, epoch, frame.seq, batch.ts, out, self.ident.dp_rank))
        # One gap per seq (its Nats-Msg-Id names the range, not the reason):
        # what the publisher sent wrong comes first.
        if malformed:
            self._announce_gap(frame.seq, frame.seq, "malformed")
        elif unpublishable:
            self._announce_gap(frame.seq, frame.seq, "unpublishable")

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

    def _encode_group(self, msg: GroupMessage, msg_id_base: str, limit: int) -> list[Outgoing] | None:
        """The group's slice as NATS messages: several if it exceeds the
        server's max_payload (events split in order, `chunk`/`chunks` say so),
        none (counted, logged, announced as a gap) if it cannot be sent at all."""
        try:
            out = self._encoder.group(msg, self.subjects, msg_id_base)
        except (TypeError, ValueError, OverflowError) as exc:
            # JSON cannot carry what msgpack can (Ext values, non-string keys)
            # in vLLM's free-form extra_keys: forward the events without them.
            for event in msg.events:
                if isinstance(event, BlockStored):
                    event.extra_keys = None
            self._metrics.transformed_by["extra_keys_dropped"].inc()
            self._log.warning("extra_keys_dropped", seq=msg.seq, group=msg.group, error=str(exc)[:200])
            try:
                out = self._encoder.group(msg, self.subjects, msg_id_base)
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
        pieces = self._split_events(msg, msg_id_base, limit, size, len(msg.events))
        if pieces is None:
            self._metrics.malformed_by["too_large_for_nats"].inc()
            self._log.warning("too_large_for_nats", seq=msg.seq, group=msg.group, bytes=size, max_payload=limit)
            return None
        self._metrics.transformed_by["split"].inc()
        return [
            self._encoder.group(
                msgspec.structs.replace(msg, events=events, chunk=i, chunks=len(pieces)), self.subjects, msg_id_base
            )
            for i, events in enumerate(pieces)
        ]

    def _split_events(self, msg: GroupMessage, msg_id_base: str, limit: int, size: int,
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
            piece_size = self._encoder.group(piece, self.subjects, msg_id_base).nbytes
            if piece_size <= limit:
                pieces.append(piece.events)
                continue
            smaller = self._split_events(piece, msg_id_base, limit, piece_size, chunks)
            if smaller is None:
                return None
            pieces.extend(smaller)
        return pieces

    @staticmethod
    def _after_last_stored(out: list[Outgoing], last_id: str) -> list[Outgoing]:
        """A bridge that died inside a batch: what follows the last message the
        stream holds is what is still owed."""
        for i, msg in enumerate(out):
            if msg.headers.get(HDR_MSG_ID) == last_id:
                return out[i + 1 :]
        return out

    def _bad_frame(self, exc: FrameError) -> None:
        self._metrics.malformed.labels(exc.reason).inc()
        self._log.warning("malformed_frame", reason=exc.reason, detail=exc.detail)
