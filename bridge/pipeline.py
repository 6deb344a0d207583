"""One vLLM publisher (endpoint × rank): ZMQ frames → seq checks and replay →
decode → normalize → encoded batches on the sink's queue."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.abc
import structlog
import zmq

from bridge import __version__
from bridge.contract import SCHEMA_VERSION, GroupMessage, RecordType, WorkerRecord
from bridge.decode.decoder import BatchDecodeError, BatchDecoder
from bridge.normalize.normalizer import KindBook, NormalizeStats, Normalizer, StreamIdentity
from bridge.observe.metrics import Metrics
from bridge.sink.encode import MessageEncoder, Outgoing
from bridge.sink.jetstream import ResumePoint
from bridge.sink.queue import BatchQueue, LostRange, OutBatch
from bridge.sink.subjects import SubjectBook, worker_token
from bridge.source.frames import Frame, FrameError, parse_pub
from bridge.source.replay import ReplayClient
from bridge.source.sequencer import SeqTracker, Verdict
from bridge.source.subscriber import Subscriber


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
        replay_timeout: float,
        idle_probe_s: float,
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
        self._ctx = ctx
        self._queue = queue
        self._encoder = encoder
        self._metrics = metrics
        self._decoder = BatchDecoder()
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
        self._last_live = time.monotonic()

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
        self._metrics.gaps.labels("queue_overflow").inc()
        self._metrics.gap_batches.inc(lost.last - lost.first + 1)
        self._log.warning("gap", first=lost.first, last=lost.last, reason="queue_overflow")
        return self.record("gap", gap=(lost.first, lost.last), reason="queue_overflow", epoch=lost.epoch)

    def _announce_gap(self, first: int, last: int, reason: str) -> None:
        if last < first:
            return
        self._metrics.gaps.labels(reason).inc()
        self._metrics.gap_batches.inc(last - first + 1)
        self._log.warning("gap", first=first, last=last, reason=reason)
        self._queue.put(self.record("gap", gap=(first, last), reason=reason))

    def stop_record(self) -> OutBatch:
        return self.record("stop", seq=self.tracker.last_emitted, batch_ts=self._last_ts)

    # -- resume (JetStream) ----------------------------------------------

    def resume(self, point: ResumePoint) -> None:
        """Continue the stream's epoch after the last batch it holds."""
        self.ident.epoch = point.epoch
        self.tracker.last_emitted = point.seq
        self._last_ts = point.ts
        self._resume = point
        self._log.info("resuming", epoch=point.epoch, seq=point.seq)

    async def _verify_resume(self, point: ResumePoint) -> None:
        """Same vLLM process as before the bridge stopped? Replay from the last
        seq the stream holds: the same seq with the same timestamp (or any later
        batch with a later one) means yes; anything else is a new process."""
        if self._replay is None:
            self._unverified = True
            return
        result = await self._replay.fetch(max(point.seq, 0))
        self._metrics.replays.labels("complete" if result.complete else "timeout").inc()
        frames = sorted(result.frames, key=lambda f: f.seq)
        if not frames:
            if result.complete:
                await self._restart_and_replay()
            else:
                self._unverified = True
            return
        first = frames[0]
        first_ts = self._peek_ts(first)
        if point.ts is None:
            continued = first.seq >= point.seq
        elif first.seq == point.seq:
            continued = first_ts == point.ts
        else:
            continued = first_ts is not None and first_ts >= point.ts and first.seq > point.seq
        if not continued:
            await self._restart_and_replay()
            return
        self._log.info("resume_verified", epoch=self.ident.epoch, seq=point.seq, replayed=len(frames))
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
        sub = Subscriber(self._ctx, self.plan.endpoint, self._topic, self._rcvhwm)
        self._log.info("zmq_subscribed", replay=self.plan.replay_endpoint, topic=self._topic)
        self._queue.put(self.record("start", reason="fresh" if self._resume is None else "resumed",
                                    seq=None if self._resume is None else self._resume.seq))
        if self._resume is not None:
            await self._verify_resume(self._resume)
        on_subscribed()
        try:
            async with anyio.create_task_group() as tg:
                if self._replay is not None and self._idle_probe_s > 0:
                    tg.start_soon(self._probe_when_idle)
                async for messages in sub.batches():
                    self._last_live = time.monotonic()
                    for parts in messages:
                        await self._on_live(parts)
        finally:
            sub.close()

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

    async def _on_live(self, parts: list[bytes]) -> None:
        try:
            frame = parse_pub(parts, self._max_frame_bytes)
        except FrameError as exc:
            self._bad_frame(exc)
            return
        if self._topic_bytes and frame.topic != self._topic_bytes:
            self._metrics.dropped.labels("foreign_topic").inc()
            return
        if self._unverified:
            # Resumed without a replay answer: a continuing process is already
            # past the stream's last seq, a new one is not.
            self._unverified = False
            if frame.seq <= self.tracker.last_emitted:
                self._restart(frame.seq)
                await self._heal(frame)
                return
        verdict = self.tracker.classify_live(frame.seq)
        if verdict is Verdict.ACCEPT:
            self._emit(frame)
        elif verdict is Verdict.DUPLICATE:
            self._metrics.dropped.labels("duplicate").inc()
        elif verdict is Verdict.GAP:
            await self._heal(frame)
        else:
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
        self._metrics.restarts.inc()
        self._log.warning("publisher_restart", previous_seq=previous, seq=seq, epoch=self.ident.epoch)
        self._queue.put(self.record("restart", seq=seq))

    async def _heal(self, live: Frame) -> None:
        async with self._replay_lock:
            if self.tracker.wants(live.seq):
                await self._heal_locked(live)
            else:
                self._metrics.dropped.labels("duplicate").inc()

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
        metrics = self._metrics
        metrics.batches_in.inc()
        self.tracker.emitted(frame.seq)
        try:
            batch = self._decoder.decode(frame.payload)
        except BatchDecodeError as exc:
            metrics.malformed.labels(exc.reason).inc()
            self._log.warning("malformed_batch", seq=frame.seq, reason=exc.reason, detail=exc.detail)
            return
        for reason, detail in batch.rejected:
            metrics.malformed.labels(reason).inc()
            self._log.warning("malformed_event", seq=frame.seq, reason=reason, detail=detail)
        if batch.dp_rank is not None and batch.dp_rank != self.ident.dp_rank and not self._rank_mismatch_logged:
            self._rank_mismatch_logged = True
            self._log.warning("dp_rank_mismatch", configured=self.ident.dp_rank, batch=batch.dp_rank)
        metrics.events_in.inc(len(batch.events))
        self._last_ts = batch.ts
        stats = NormalizeStats()
        items = self._normalizer.normalize(self.ident, frame.seq, batch.ts, batch.events, time.time(), stats)
        for reason, n in stats.dropped.items():
            metrics.dropped.labels(reason).inc(n)
        for what, n in stats.transformed.items():
            metrics.transformed.labels(what).inc(n)
        msg_id_base = f"{self._token}:{self.ident.dp_rank}:{self.ident.epoch}"
        out: list[Outgoing] = []
        clears = 0
        for item in items:
            if type(item) is GroupMessage:
                out.append(self._encoder.group(item, self.subjects, msg_id_base))
            else:
                clears += 1
                msg_id = f"{msg_id_base}:{frame.seq}:worker:cleared{clears}"
                out.append(self._encoder.record(item, self.subjects, msg_id))  # type: ignore[arg-type]
        self._queue.put(OutBatch(self.plan.index, self.ident.epoch, frame.seq, batch.ts, out, self.ident.dp_rank))

    def _bad_frame(self, exc: FrameError) -> None:
        self._metrics.malformed.labels(exc.reason).inc()
        self._log.warning("malformed_frame", reason=exc.reason, detail=exc.detail)
