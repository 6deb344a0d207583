"""The stream made or verified, its state when publishes bounce, and every
rank's resume point read back before the first batch is taken."""

from __future__ import annotations

from collections import Counter as CountOf
from collections.abc import Callable, Sequence
from enum import Enum

import anyio
import nats.errors
import nats.js
import nats.js.errors
import structlog

from bridge.contract.identity import Refusal
from bridge.producer.config import Settings
from bridge.producer.sink.jetstream import ResumePoint, StreamConfigError, ensure_stream
from bridge.producer.sink.resume import NOT_YET, read_point
from bridge.producer.telemetry.health import Health

log = structlog.get_logger("bridge.jetstream")

# What asking for the stream may raise while JetStream does not answer.
_UNAVAILABLE = (*NOT_YET, nats.errors.OutboundBufferLimitError, nats.js.errors.NoStreamResponseError)


class StreamState(Enum):
    """What the stream is, asked after a publish found no responder."""

    CREATED = "created"  # it was gone: made again
    PRESENT = "present"  # it is there and takes our subjects: its leader is being elected
    MISMATCH = "mismatch"  # it is there but cannot take our subjects (the operator's to fix)
    UNAVAILABLE = "unavailable"  # JetStream does not answer right now


async def stream_state(js: nats.js.JetStreamContext, settings: Settings) -> StreamState:
    """Makes the stream again if it is gone; says what it found."""
    try:
        created = await ensure_stream(js, settings)
    except StreamConfigError as exc:
        log.error("stream_mismatch", stream=settings.stream_name, error=str(exc)[:200])
        return StreamState.MISMATCH
    except _UNAVAILABLE as exc:
        log.warning("stream_unavailable", stream=settings.stream_name, error=type(exc).__name__)
        return StreamState.UNAVAILABLE
    return StreamState.CREATED if created else StreamState.PRESENT


async def open_stream(current_js: Callable[[], nats.js.JetStreamContext], settings: Settings, health: Health,
                      ranks: Sequence[tuple[str, int]], denied: Callable[[str], bool],
                      passed: CountOf[Refusal] | None = None) -> list[ResumePoint | None]:
    """The stream made or verified, and each rank's resume point (`ranks`:
    its subject base and dp rank) read back. Until both answer (a cluster
    without a JetStream leader yet, a new replicated stream whose replicas do
    not answer direct gets yet, a stream the operator must fix, a permission
    missing) it says why, retries, and keeps the bridge not ready; nothing is
    read from ZMQ meanwhile (vLLM's replay buffer holds it). A rank whose last
    message the NATS user may not read back starts fresh instead (said once).
    `current_js` is asked on every try: the client may be replaced meanwhile.
    Messages on a rank's subjects it passed over as not the bridge's own
    (last_point) are counted in `passed`."""
    delay = 0.2
    created = False
    points: list[ResumePoint | None] = []
    while len(points) < len(ranks):
        base, dp_rank = ranks[len(points)]
        js = current_js()
        try:
            if not created:
                await ensure_stream(js, settings)
                created = True
            read = await read_point(js, settings.stream_name, base, denied, passed)
        except (StreamConfigError, *NOT_YET) as exc:
            health.stream_ready = False
            refused = isinstance(exc, StreamConfigError)
            (log.error if refused else log.warning)(
                "stream_refused" if refused else "stream_not_ready", stream=settings.stream_name,
                step="resume point" if created else "stream",
                error=type(exc).__name__, detail=str(exc)[:200], retry_in=delay,
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        if not read.permitted:
            log.error("resume_point_forbidden", stream=settings.stream_name, subject=f"{base}.>",
                      dp_rank=dp_rank, hint="the NATS user may not read back this rank's "
                      "last message (direct get): it starts fresh")
        points.append(read.point)
    health.stream_ready = True
    return points
