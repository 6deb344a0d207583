"""A rank's own messages, read back from the stream as it stores them.

A direct get answers with the stored headers and the server's own
(`Nats-Stream`, `Nats-Subject`, ...) in one set, so it cannot tell a bridge's
message from a copy someone's read left on the rank's subjects
(bridge.contract.identity). A consumer delivers the stored headers as they
are. The rank's consumer is named for the rank and filtered to its subjects in
the API subject, so a least-privilege user may make just this one
(docs/security.md); the resume point and the rebuild use it one after the
other, never at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import nats.errors
import nats.js
import nats.js.errors
import structlog
from nats.js import api

log = structlog.get_logger("bridge.jetstream")

FETCH = 256
FETCH_TIMEOUT_S = 2.0


class StoredMessage(NamedTuple):
    """One message of the stream, with the headers it was stored with."""

    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes


def rank_consumer(subject_base: str) -> str:
    """The consumer name of the rank whose subjects are `<subject_base>.>`
    (its worker token is the last token), on the stream and on the snapshot bucket."""
    return f"kvb-rebuild-{subject_base.rpartition('.')[2]}"


async def read_rank(js: nats.js.JetStreamContext, stream: str, subject_base: str, start: int,
                    on_batch: Callable[[list[StoredMessage]], bool], *, before: int | None = None) -> int:
    """The rank's messages from stream sequence `start` on, in stream order,
    handed to `on_batch` a batch at a time until it returns False, the
    messages stored when the read began are all read, or (`before`) the next
    one's sequence is `before` or later. Returns how many were handed over."""
    return await read_stored(js, stream, rank_consumer(subject_base), f"{subject_base}.>", on_batch, start=start,
                             before=before)


async def read_stored(js: nats.js.JetStreamContext, stream: str, name: str, filter_subject: str,
                      on_batch: Callable[[list[StoredMessage]], bool], *, start: int | None = None,
                      before: int | None = None) -> int:
    """`read_rank` with any consumer name and filter; `start` None reads the
    last message of each subject the filter matches (a bucket's keys)."""
    config = api.ConsumerConfig(
        name=name, filter_subject=filter_subject, ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0,
        mem_storage=True, num_replicas=1,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT if start is None else api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if start is None else max(1, start),
    )
    try:
        info = await js.add_consumer(stream, config)
    except nats.js.errors.BadRequestError:
        # one of its name left by a bridge that died reading (another start
        # sequence): it would go by itself after inactive_threshold
        await js.delete_consumer(stream, name)
        info = await js.add_consumer(stream, config)
    handed = 0
    try:
        remaining = info.num_pending
        if not remaining:
            return 0
        sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
        try:
            while remaining:
                try:
                    msgs = await sub.fetch(min(FETCH, remaining), timeout=FETCH_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    break
                batch = []
                for msg in msgs:
                    meta = msg.metadata
                    if before is not None and meta.sequence.stream >= before:
                        remaining = 0
                        break
                    batch.append(StoredMessage(meta.sequence.stream, msg.subject, dict(msg.headers or {}),
                                               msg.data))
                    remaining = meta.num_pending
                handed += len(batch)
                if batch and not on_batch(batch):
                    break
        finally:
            await sub.unsubscribe()
    finally:
        try:
            await js.delete_consumer(stream, name)
        except Exception as exc:  # it goes by itself after inactive_threshold
            log.debug("rank_consumer_delete_failed", consumer=name, error=type(exc).__name__)
    return handed
