"""JetStream: the stream the bridge publishes into, and where it left off.

The stream is the record of every worker's events, so on start the bridge reads
back, per worker and rank, the last message it published (`last_point`) and
resumes from there through vLLM's replay socket.
"""

from __future__ import annotations

from collections import Counter as CountOf
from collections.abc import Callable, Mapping
from typing import Final, TypeVar

import msgspec
import nats.errors
import nats.js
import nats.js.api
import nats.js.errors
import structlog

from bridge.contract import DEFAULT_FORMAT, HDR_FORMAT, HDR_MSG_ID, GroupMessage, WorkerRecord
from bridge.contract.identity import Refusal, check, reply_copy, subject_origin
from bridge.producer.config import Settings
from bridge.producer.sink.kv_bucket import warn_unguarded
from bridge.producer.sink.rank_reader import StoredMessage, read_rank

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


# Messages of the rank's subjects read back past ones that are not its own
# (copies, see last_point) before the resume point is given up as unknown.
# The read steps back in spans of stream sequences growing 4 times a step
# and stops once this many are read: at most about 5 times this in all.
STEP_BACK_MAX: Final = 4096
_FIRST_SPAN = 64


async def last_point(js: nats.js.JetStreamContext, stream: str, subject_base: str,
                     refused: CountOf[Refusal] | None = None) -> ResumePoint | None:
    """What the stream last holds of the bridge's own under `<subject_base>.>`.

    The bridge alone may publish there, but a JetStream read answered onto one
    of these subjects (bridge.contract.identity) stores a copy of any message
    there, whatever it says. The direct get finds the last message; the
    rank's consumer (bridge.producer.sink.rank_reader) shows whether it is
    a copy, and past copies the read steps back, in growing spans, through at
    most STEP_BACK_MAX of the rank's messages. Each message passed over is
    counted in `refused` by reason. None when nothing of the bridge's is
    found. A user not allowed the rank's consumer gets the direct get's
    answer, unchecked (logged)."""
    try:
        raw = await js.get_last_msg(stream, f"{subject_base}.>", direct=True)
    except nats.js.errors.NotFoundError:
        return None
    if raw.seq is None or raw.data is None:
        return None
    passed = refused if refused is not None else CountOf()
    try:
        found, read, before = await _step_back(js, stream, subject_base, raw.seq, passed)
    except nats.js.errors.NotFoundError:
        return None
    except _UNCHECKED as exc:
        log.warning("resume_point_unchecked", subject=f"{subject_base}.>", error=type(exc).__name__,
                    hint="the NATS user may not make the rank's consumer (docs/security.md): the last "
                         "message is taken as the bridge's own, unchecked")
        point, _ = _point_of(StoredMessage(raw.seq, raw.subject or "", {}, raw.data), raw.headers or {})
        return point
    if passed.total():
        log.warning("resume_point_copies_passed", subject=f"{subject_base}.>", passed=passed.total(),
                    reasons={r.value: n for r, n in passed.items()}, found=found is not None,
                    note="messages on the bridge's own subjects that it did not publish")
    if found is None and before > 1:
        log.error("resume_point_buried", subject=f"{subject_base}.>", read=read, step_back_max=STEP_BACK_MAX,
                  hint="more messages that are not the bridge's on top of its last than the bound: it starts fresh")
    return found


# What a read with the rank's consumer raises when the user may not make it
# (no answer comes) or JetStream does not answer.
_UNCHECKED = (nats.errors.Error, TimeoutError, OSError)


async def _step_back(js: nats.js.JetStreamContext, stream: str, subject_base: str, last_seq: int,
                     passed: CountOf[Refusal]) -> tuple[ResumePoint | None, int, int]:
    """The newest of the bridge's own messages at or before `last_seq`:
    (its point or None, the rank's messages read, the lowest sequence looked at)."""
    before, span, read = last_seq + 1, 1, 0
    while before > 1 and read < STEP_BACK_MAX:
        start = max(1, before - span)
        mine: list[StoredMessage] = []
        read += await read_rank(js, stream, subject_base, start, _collect(mine), before=before)
        for msg in reversed(mine):
            point, why = _point_of(msg, msg.headers)
            if point is not None:
                return point, read, start
            if why is not None:
                passed[why] += 1
        before = start
        span = _FIRST_SPAN if span == 1 else span * 4
    return None, read, before


def _collect(into: list[StoredMessage]) -> Callable[[list[StoredMessage]], bool]:
    def take(batch: list[StoredMessage]) -> bool:
        into.extend(batch)
        return True
    return take


def _point_of(msg: StoredMessage, headers: Mapping[str, str]) -> tuple[ResumePoint | None, Refusal | None]:
    """The resume point a stored message gives (`headers`: as read), or why
    it is not the bridge's own (None, None: unreadable)."""
    if reply_copy(msg.headers):
        return None, Refusal.REPLY_COPY
    fmt = headers.get(HDR_FORMAT, DEFAULT_FORMAT)
    msg_id = headers.get(HDR_MSG_ID)
    origin = subject_origin(msg.subject)
    try:
        if origin is not None and origin.group is None:
            rec = _decode(fmt, WorkerRecord, msg.data)
            why = check(origin, rec.worker, rec.dp_rank, None)
            return (None, why) if why is not None else (_after_record(rec, msg_id), None)
        group: GroupMessage = _decode(fmt, GroupMessage, msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("resume_point_unreadable", subject=msg.subject, seq=msg.seq, error=str(exc)[:200])
        return None, None
    why = check(origin, group.worker, group.dp_rank, group.group)
    if why is not None:
        return None, why
    return ResumePoint(group.epoch, group.seq - 1, group.seq, group.ts, msg_id), None


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
