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

from bridge.config import Settings
from bridge.contract import HDR_FORMAT, GroupMessage, WorkerRecord

log = structlog.get_logger("bridge.jetstream")

T = TypeVar("T")


class ResumePoint(msgspec.Struct, frozen=True):
    """The last batch the stream holds for one worker and rank."""

    epoch: int
    seq: int  # -1: the epoch began but no batch made it into the stream
    ts: float | None  # vLLM's timestamp of batch `seq`, to recognise the same process


class StreamConfigError(RuntimeError):
    pass


def stream_config(settings: Settings) -> nats.js.api.StreamConfig:
    return nats.js.api.StreamConfig(
        name=settings.stream_name,
        subjects=[f"{settings.subject_prefix}.>"],
        retention=nats.js.api.RetentionPolicy.LIMITS,
        storage=nats.js.api.StorageType.FILE,
        max_age=settings.stream_max_age,
        max_msgs_per_subject=settings.stream_max_msgs_per_subject,
        duplicate_window=settings.stream_duplicate_window,
        num_replicas=settings.stream_replicas,
        allow_direct=True,
        discard=nats.js.api.DiscardPolicy.OLD,
    )


async def ensure_stream(js: nats.js.JetStreamContext, settings: Settings) -> None:
    """Create the stream, or check that an existing one can take our subjects.
    An existing stream's limits are the operator's: they are logged, not changed."""
    wanted = stream_config(settings)
    try:
        info = await js.stream_info(settings.stream_name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(wanted)
        log.info("stream_created", stream=settings.stream_name, subjects=wanted.subjects, max_age=wanted.max_age,
                 max_msgs_per_subject=wanted.max_msgs_per_subject, duplicate_window=wanted.duplicate_window)
        return
    have = info.config
    subject = f"{settings.subject_prefix}.>"
    if subject not in (have.subjects or []):
        raise StreamConfigError(
            f"stream {settings.stream_name} exists with subjects {have.subjects}, not {subject}"
        )
    if not have.allow_direct:
        raise StreamConfigError(f"stream {settings.stream_name} needs allow_direct for resume")
    log.info("stream_verified", stream=settings.stream_name, max_age=have.max_age,
             max_msgs_per_subject=have.max_msgs_per_subject, duplicate_window=have.duplicate_window)


async def last_point(js: nats.js.JetStreamContext, stream: str, subject_base: str) -> ResumePoint | None:
    """What the stream last holds under `<prefix>.<worker-token>.>`."""
    try:
        raw = await js.get_last_msg(stream, f"{subject_base}.>", direct=True)
    except nats.js.errors.NotFoundError:
        return None
    if raw.data is None:
        return None
    fmt = (raw.headers or {}).get(HDR_FORMAT, "msgpack")
    try:
        if (raw.subject or "").endswith(".worker"):
            record: WorkerRecord = _decode(fmt, WorkerRecord, raw.data)
            return ResumePoint(record.epoch, -1 if record.seq is None else record.seq, record.batch_ts)
        group: GroupMessage = _decode(fmt, GroupMessage, raw.data)
        return ResumePoint(group.epoch, group.seq, group.ts)
    except msgspec.DecodeError as exc:
        log.warning("resume_point_unreadable", subject=raw.subject, error=str(exc)[:200])
        return None


def _decode(fmt: str, type_: type[T], data: bytes) -> T:
    return msgspec.json.decode(data, type=type_) if fmt == "json" else msgspec.msgpack.decode(data, type=type_)
