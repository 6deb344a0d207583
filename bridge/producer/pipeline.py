"""One vLLM publisher (endpoint × rank), wired as stages: ZMQ frames →
continuity (seq order, replay) → decode and normalize → framing → the sink's
queue. Worker records (gaps, restarts, stops) go through the Announcer."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import structlog
import zmq

from bridge.contract import GroupMessage, WorkerRecord
from bridge.contract.msgid import new_epoch
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, StreamIdentity
from bridge.producer.normalize.stage import NormalizeStage
from bridge.producer.plan import StreamPlan, StreamSettings
from bridge.producer.sink.announce import Announcer
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.framing import Framing
from bridge.producer.sink.jetstream import ResumePoint
from bridge.producer.sink.queue import BatchQueue, LostRange, OutBatch
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.source.continuity import Continuity
from bridge.producer.source.frames import FrameError, socket_limit
from bridge.producer.source.recovery import ReplayPolicy
from bridge.producer.source.replay import ReplayClient
from bridge.producer.source.sequencer import SeqTracker
from bridge.producer.source.subscriber import Subscriber
from bridge.producer.source.zmq_io import InputWatch
from bridge.producer.telemetry.metrics import Metrics

# A sink that took no batch for this long is stalled, not slow.
_STALLED_AFTER_S = 0.5


class StreamPipeline:
    """`max_payload`: the server's message limit; `nats_up`: whether NATS is
    connected; `keep_bodies`: whether a batch's messages carry the structs
    they encode, for the snapshot keeper (`Framing`)."""

    def __init__(self, plan: StreamPlan, settings: StreamSettings, *, ctx: zmq.Context[zmq.Socket[bytes]],
                 queue: BatchQueue, encoder: MessageEncoder, metrics: Metrics, max_payload: Callable[[], int],
                 nats_up: Callable[[], bool], watch: InputWatch | None = None,
                 keep_bodies: Callable[[], bool] | None = None) -> None:
        self.plan = plan
        self._watch = watch
        self._settings = settings
        self._ctx = ctx
        self._queue = queue
        self._metrics = metrics
        self._nats_up = nats_up
        self.subjects = SubjectBook(settings.prefix, settings.worker, plan.dp_rank)
        self.ident = StreamIdentity(worker=settings.worker, dp_rank=plan.dp_rank, topic=settings.topic,
                                    epoch=new_epoch())
        self._log = structlog.get_logger("bridge.stream").bind(
            worker=settings.worker, dp_rank=plan.dp_rank, endpoint=plan.endpoint
        )
        self._framing = Framing(plan.index, self.ident, self.subjects, encoder, max_payload, metrics, self._log,
                                keep_bodies=keep_bodies)
        self.announce = Announcer(self._framing, queue, metrics, self._log)
        self._stage = NormalizeStage(
            self.ident, BatchDecoder(relay=encoder.format == "msgpack"),
            Normalizer(KindBook(settings.pinned_kinds), settings.keep_placeholders), metrics, self._log,
            deliver=self._deliver, gap=self.announce.gap, redact_prompts=settings.redact_prompts,
        )
        replay = (
            ReplayClient(ctx, plan.replay_endpoint, settings.replay_timeout, settings.max_frame_bytes, self._bad_frame)
            if plan.replay_endpoint
            else None
        )
        self._continuity = Continuity(
            topic=settings.topic.encode("utf-8"), max_frame_bytes=settings.max_frame_bytes, replay=replay,
            policy=ReplayPolicy(settings.replay_timeout, settings.replay_retries), idle_probe_s=settings.idle_probe_s,
            metrics=metrics, log=self._log, emit=self._stage.frame,
            gap=self.announce.gap, restart=self._restart, bad_frame=self._bad_frame, timestamp=self._stage.timestamp,
        )

    @property
    def tracker(self) -> SeqTracker:
        return self._continuity.tracker

    def gap_batch(self, lost: LostRange) -> OutBatch:
        """The record naming batches the queue dropped."""
        return self.announce.gap_record(lost.first, lost.last, "queue_overflow", lost.epoch)

    def stop_record(self) -> OutBatch:
        return self.announce.record("stop", seq=self.tracker.last_emitted, batch_ts=self._stage.last_ts)

    def resume(self, point: ResumePoint) -> None:
        """Continue the stream's epoch after the last batch it wholly holds."""
        self.ident.epoch = point.epoch
        self._continuity.resume(point.epoch, point.done_through, point.check_seq, point.check_ts)
        self._stage.last_ts = point.check_ts
        if point.partial_msg_id is not None:
            self._framing.resume_inside(point.done_through + 1, point.partial_msg_id)
        self._log.info("resuming", epoch=point.epoch, done_through=point.done_through,
                       partial=point.partial_msg_id is not None)

    async def run(self, on_subscribed: Callable[[], None]) -> None:
        s = self._settings
        continuity = self._continuity
        sub = Subscriber(self._ctx, self.plan.endpoint, s.topic, s.rcvhwm, s.coalesce_s,
                         socket_limit(s.max_frame_bytes), self._watch)
        self._log.info("zmq_subscribed", replay=self.plan.replay_endpoint, topic=s.topic)
        through = continuity.resumed_through
        self.announce.put("start", reason="fresh" if through is None else "resumed", seq=through)
        await continuity.verify_resume()
        on_subscribed()
        try:
            async with anyio.create_task_group() as tg:
                if continuity.probes:
                    tg.start_soon(continuity.probe_when_idle)
                queue = self._queue
                take = continuity.take_live
                async for messages in sub.batches():
                    continuity.heard()
                    for parts in messages:
                        # In-order batches are handled without an await; only
                        # gaps, restarts and resume checks need replay.
                        pending = take(parts)
                        if pending is not None:
                            await continuity.settle(*pending)
                        if queue.full():
                            await queue.hold(self._nats_up, _STALLED_AFTER_S)
        finally:
            sub.close()

    def _deliver(self, seq: int, ts: float, items: list[GroupMessage | WorkerRecord], malformed: bool) -> None:
        """One batch's messages on the queue, then a gap record if what it said
        did not all come through: one per seq (its Nats-Msg-Id names the range,
        not the reason), what the publisher sent wrong first."""
        out, unpublishable = self._framing.batch(seq, ts, items)
        self._queue.put(out)
        if malformed:
            self.announce.gap(seq, seq, "malformed")
        elif unpublishable:
            self.announce.gap(seq, seq, "unpublishable")

    def _restart(self, seq: int | None, previous: int) -> None:
        self.ident.epoch = new_epoch(self.ident.epoch)
        self._stage.restarted()
        self._framing.restarted()
        self._metrics.restarts.inc()
        self._log.warning("publisher_restart", previous_seq=previous, seq=seq, epoch=self.ident.epoch)
        self.announce.put("restart", seq=seq)

    def _bad_frame(self, exc: FrameError) -> None:
        self._metrics.malformed_by[exc.reason].inc()
        self._log.warning("malformed_frame", reason=exc.reason, detail=exc.detail)
