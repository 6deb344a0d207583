"""Each worker-rank's resume point, read back from the stream, or refused.

A direct get (`$JS.API.DIRECT.GET.<stream>.<subject>`) the NATS user may not
make never gets an answer, only a permission violation on the connection: the
read races the sink's record of refusals, so a refused rank starts fresh at
once instead of waiting out a timeout.
"""

from __future__ import annotations

from collections import Counter as CountOf
from collections.abc import Callable

import anyio
import nats.errors
import nats.js
import nats.js.errors

from bridge.contract.identity import Refusal
from bridge.producer.sink.jetstream import ResumePoint, last_point

# What the stream's set-up may answer while it is not ready yet.
NOT_YET = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.APIError,
    TimeoutError,
    OSError,
)


def direct_get_subject(stream: str, subject_base: str) -> str:
    """The API subject a last-message direct get for the rank's subjects is published to."""
    return f"$JS.API.DIRECT.GET.{stream}.{subject_base}.>"


class ResumeRead:
    """The outcome of one read: `permitted` False when the server refused it."""

    __slots__ = ("permitted", "point")

    def __init__(self, permitted: bool, point: ResumePoint | None) -> None:
        self.permitted = permitted
        self.point = point


async def read_point(js: nats.js.JetStreamContext, stream: str, subject_base: str,
                     denied: Callable[[str], bool], passed: CountOf[Refusal] | None = None) -> ResumeRead:
    """The stream's last point for `<subject_base>.>`, or a refused read as
    soon as `denied` reports the direct get (`passed`: as last_point's `refused`).
    Raises one of NOT_YET when the stream does not answer yet."""
    request = direct_get_subject(stream, subject_base)
    outcome: list[ResumeRead | BaseException] = []
    async with anyio.create_task_group() as tg:

        async def get() -> None:
            try:
                outcome.append(ResumeRead(True, await last_point(js, stream, subject_base, passed)))
            except NOT_YET as exc:
                outcome.append(exc)
            tg.cancel_scope.cancel()

        async def refused() -> None:
            while not denied(request):
                await anyio.sleep(0.05)
            outcome.append(ResumeRead(False, None))
            tg.cancel_scope.cancel()

        tg.start_soon(get)
        tg.start_soon(refused)
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result
