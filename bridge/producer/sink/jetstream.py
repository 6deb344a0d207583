"""JetStream: the stream the bridge publishes into, and where it left off.

The stream is the record of every worker's events, so on start the bridge reads
back, per worker and rank, the last message it published (direct get by
subject) and resumes from there through vLLM's replay socket.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import nats.js
import nats.js.api
import nats.js.errors
import structlog

from bridge.contract import DEFAULT_FORMAT, HDR_FORMAT, HDR_MSG_ID, WORKER_TOKEN, GroupMessage, WorkerRecord
from bridge.producer.config import Settings
from bridge.producer.sink.kv_bucket import warn_unguarded

log = structlog.get_logger("bridge.jetstream")

T = TypeVar("T")


class ResumePoint(msgspec.Struct, frozen=True):
    """Where the stream left one worker and rank.

    `done_through`: every batch up to this seq is wholly in the stream.
    `check_seq`/`check_ts`: a batch whose vLLM timestamp the stream knows, so
    replay can tell the same vLLM process from a new one (None: no evidence).
    `partial_msg_id`: batch done_through + 1 is in the stream only up to this
    message (the bridge died between the messages of one batch).
    """

    epoch: int
    done_through: int
    check_seq: int | None = None
    check_ts: float | None = None
    partial_msg_id: str | None = None


class StreamConfigError(RuntimeError):
    pass


def stream_config(settings: Settings) -> nats.js.api.StreamConfig:
    return nats.js.api.StreamConfig(
        name=settings.stream_name,
        subjects=[f"{settings.subject_prefix}.>"],
        retention=nats.js.api.RetentionPolicy.LIMITS,
        storage=nats.js.api.StorageType.FILE,
        max_age=settings.stream_max_age,
        max_bytes=settings.stream_max_bytes,
        max_msgs_per_subject=settings.stream_max_msgs_per_subject,
        duplicate_window=settings.stream_duplicate_window,
        num_replicas=settings.stream_replicas,
        allow_direct=True,
        discard=nats.js.api.DiscardPolicy.OLD,
        # A permission sees subjects, not headers: a worker allowed only its
        # own subjects could purge every worker's with `Nats-Rollup: all` if
        # the stream took it. Deletes and purges go through API subjects a
        # permission list does see, which only an admin is given.
        allow_rollup_hdrs=False,
    )


async def ensure_stream(js: nats.js.JetStreamContext, settings: Settings) -> bool:
    """Create the stream (True), or check that an existing one can take our
    subjects (False). An existing stream's limits and replicas are the
    operator's: they are logged, not changed."""
    wanted = stream_config(settings)
    try:
        info = await js.stream_info(settings.stream_name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(wanted)
        log.info("stream_created", stream=settings.stream_name, subjects=wanted.subjects, max_age=wanted.max_age,
                 max_bytes=wanted.max_bytes, max_msgs_per_subject=wanted.max_msgs_per_subject,
                 duplicate_window=wanted.duplicate_window, replicas=wanted.num_replicas)
        return True
    have = info.config
    subject = f"{settings.subject_prefix}.>"
    if subject not in (have.subjects or []):
        raise StreamConfigError(
            f"stream {settings.stream_name} exists with subjects {have.subjects}, not {subject}"
        )
    if not have.allow_direct:
        raise StreamConfigError(f"stream {settings.stream_name} needs allow_direct for resume")
    warn_unguarded(settings.stream_name, have)
    log.info("stream_verified", stream=settings.stream_name, max_age=have.max_age, max_bytes=have.max_bytes,
             max_msgs_per_subject=have.max_msgs_per_subject, duplicate_window=have.duplicate_window,
             replicas=have.num_replicas, leader=info.cluster.leader if info.cluster else None)
    if have.num_replicas != wanted.num_replicas:
        log.warning("stream_replicas_differ", stream=settings.stream_name, replicas=have.num_replicas,
                    asked=wanted.num_replicas, hint="an existing stream keeps its configuration")
    return False


async def last_point(js: nats.js.JetStreamContext, stream: str, subject_base: str) -> ResumePoint | None:
    """What the stream last holds under `<prefix>.<worker-token>.>`."""
    try:
        raw = await js.get_last_msg(stream, f"{subject_base}.>", direct=True)
    except nats.js.errors.NotFoundError:
        return None
    if raw.data is None:
        return None
    headers = raw.headers or {}
    fmt = headers.get(HDR_FORMAT, DEFAULT_FORMAT)
    msg_id = headers.get(HDR_MSG_ID)
    try:
        if (raw.subject or "").endswith(f".{WORKER_TOKEN}"):
            return _after_record(_decode(fmt, WorkerRecord, raw.data), msg_id)
        group: GroupMessage = _decode(fmt, GroupMessage, raw.data)
        return ResumePoint(group.epoch, group.seq - 1, group.seq, group.ts, msg_id)
    except msgspec.DecodeError as exc:
        log.warning("resume_point_unreadable", subject=raw.subject, error=str(exc)[:200])
        return None


def _after_record(rec: WorkerRecord, msg_id: str | None) -> ResumePoint:
    """What each record type says about the batches before it."""
    if rec.type == "cleared" and rec.seq is not None:
        # inside batch `seq`, like a group message of it
        return ResumePoint(rec.epoch, rec.seq - 1, rec.seq, rec.batch_ts, msg_id)
    if rec.type == "stop" and rec.seq is not None:
        return ResumePoint(rec.epoch, rec.seq, rec.seq if rec.batch_ts is not None else None, rec.batch_ts)
    if rec.type == "gap" and rec.gap_to is not None:
        return ResumePoint(rec.epoch, rec.gap_to)
    if rec.type == "start" and rec.seq is not None:
        return ResumePoint(rec.epoch, rec.seq)
    # a fresh start, or a restart record (it names the new process's first live
    # seq, which was not published yet): nothing of this epoch is in the stream
    return ResumePoint(rec.epoch, -1)


def _decode(fmt: str, type_: type[T], data: bytes) -> T:
    return msgspec.json.decode(data, type=type_) if fmt == "json" else msgspec.msgpack.decode(data, type=type_)
