"""Subscribing to the contract: core NATS (live) or a JetStream replay.

Core NATS delivers only what is published while connected, so a disconnect or
a slow-consumer drop loses messages without a trace on the bus; the subscriber
turns both into an `Interruption` item, in order, before the next message, and a
residency index treats it like a gap for every worker. A JetStream replay uses
a consumer of the reader's own name, re-created at the next stream sequence
on any hiccup (bridge.client.consumer), so it has no interruptions to report.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final, Literal

import anyio
import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from bridge.client.bootstrap import (
    BootstrapOptions,
    Found,
    LiveGate,
    RankKey,
    SnapshotSource,
    discover,
    fetch_all,
    open_snapshot_bucket,
    rank_of,
    splice_buffer,
    stream_opening,
)
from bridge.client.codec import Body, BusCodec, BusDecodeError
from bridge.client.connection import BusConnection
from bridge.client.consumer import OwnConsumer
from bridge.client.coverage import SubjectFilter
from bridge.client.identity import IdentityGuard
from bridge.contract import DEFAULT_STREAM
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing
from bridge.residency.index import Interruption
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.stream_state import stream_holdings

# While fetching snapshots, how often an idle buffering loop looks for messages.
_TAKE_POLL_S: Final = 0.002
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class StartAt(msgspec.Struct, frozen=True):
    """Where a JetStream replay begins: the whole stream, a stream sequence, or
    a wall-clock time (unix seconds)."""

    policy: Literal["all", "seq", "time", "snapshot"]
    seq: int = 0
    time: float = 0.0


def parse_since(text: str, now: float | None = None) -> StartAt:
    """`all`, `snapshot` (each rank's snapshot, then the stream after it), a
    stream sequence (`12345`), an age (`90s`, `10m`, `2h`, `1d`) or an
    ISO-8601 time (`2025-01-31T12:00:00Z`). Raises ValueError."""
    text = text.strip()
    if text in ("all", "snapshot"):
        return StartAt(text)  # type: ignore[arg-type]
    if text.isdigit():
        seq = int(text)
        if seq < 1:
            raise ValueError("stream sequences start at 1")
        return StartAt("seq", seq=seq)
    match = _DURATION.match(text)
    if match:
        age = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        return StartAt("time", time=(time.time() if now is None else now) - age)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected all, snapshot, a stream sequence, an age like 10m, or an ISO time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return StartAt("time", time=when.timestamp())


class BusMessage(msgspec.Struct, gc=False):
    """One decoded contract message."""

    subject: str
    headers: dict[str, str]
    body: Body
    # This process's clock when the message came off the socket, for lag.
    received: float
    # Set on JetStream replays: the stream sequence, to resume from.
    stream_seq: int | None = None


BusItem = BusMessage | Interruption | RankSnapshot | SnapshotMissing


def consumer_config(start: StartAt) -> api.ConsumerConfig:
    if start.policy == "seq":
        return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start.seq)
    if start.policy == "time":
        when = dt.datetime.fromtimestamp(start.time, tz=dt.UTC)
        return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=when)
    return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)


class BusSubscriber:
    """Typed messages from `<prefix>.>` (or any narrower filter), in order.

    ::

        async with BusSubscriber(conn, "kv.>") as sub:
            async for item in sub:
                index.apply(item)

    With `bootstrap` (core NATS) or `since=StartAt("snapshot")` (a stream),
    the items begin with the snapshot (or a SnapshotMissing) of each worker
    rank the subject filter covers, holding only the groups it covers
    (bridge.client.coverage), and go on with only what came after it
    (bridge.client.bootstrap); a rank first seen later, not with a record
    that resets it, gets a SnapshotMissing first.
    """

    def __init__(
        self,
        conn: BusConnection,
        subject: str = "kv.>",
        *,
        since: StartAt | None = None,
        stream: str = DEFAULT_STREAM,
        codec: BusCodec | None = None,
        bootstrap: BootstrapOptions | None = None,
    ) -> None:
        self._conn = conn
        self.subject = subject
        self.since = since
        self.stream = stream
        self._codec = codec or BusCodec()
        self._sub: Subscription | None = None
        self._consumer: OwnConsumer | None = None
        self.undecodable = 0
        # Messages whose payload speaks for another worker, rank or group
        # than the subject they came on, and reply-subject copies: refused,
        # per reason (`identity.refused`).
        self.identity = IdentityGuard()
        self.delivered = 0
        self._seen_disconnects = 0
        self._seen_drops = 0
        if bootstrap is None and since is not None and since.policy == "snapshot":
            bootstrap = BootstrapOptions()
        self.bootstrap = bootstrap
        # Where each rank's bootstrap came from (empty until it ran).
        self.sources: list[SnapshotSource] = []
        # Bootstrapping: the items it begins with; after it, the live-phase rules.
        self._opening: list[BusItem] = []
        self._gate: LiveGate | None = None
        # True once every item the subscription opens with (each rank's
        # snapshot or SnapshotMissing, the spliced buffer) has been handed
        # out: a reader that applied them is caught up with what it found.
        self.opened = False

    async def start(self) -> None:
        nc = self._conn.nc
        if nc is None:
            raise RuntimeError("BusConnection.open() first")
        if self.since is None:
            self._sub = await nc.subscribe(self.subject)
            # Registered with the server before we return: a caller may publish next.
            await flushed(nc)
        else:
            config = await self._stream_bootstrap() if self.since.policy == "snapshot" else consumer_config(self.since)
            self._consumer = OwnConsumer(nc, self.stream, config.evolve(filter_subject=self.subject))
            await self._consumer.start()
        self._seen_disconnects = self._conn.disconnects

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be gone; nothing left to undo
                pass

    async def __aenter__(self) -> BusSubscriber:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def __aiter__(self) -> AsyncIterator[BusItem]:
        return self.items()

    async def items(self) -> AsyncIterator[BusItem]:
        if self._sub is None and self._consumer is None:
            raise RuntimeError("start() first")
        if self.bootstrap is not None and self.since is None:
            self._opening = await self._core_bootstrap()
        opening, self._opening = self._opening, []
        for first in opening:
            yield first
        self.opened = True
        async for msg in self._source():
            interruption = self._interruption()
            if interruption is not None:
                yield interruption
            item = self._decode(msg)
            if item is None:
                continue
            after = None
            if self._gate is not None:
                missing, admitted = self._gate.admit(item.body, item.stream_seq)
                if missing is not None:
                    yield missing
                if not admitted:
                    continue  # in the rank's snapshot already
                after = self._gate.after(item.body, item.stream_seq)
            self.delivered += 1
            yield item
            if after is not None:
                yield after

    def _source(self) -> AsyncIterator[Msg]:
        if self._consumer is not None:
            return self._consumer.messages()
        assert self._sub is not None
        return self._sub.messages

    async def _core_bootstrap(self) -> list[BusItem]:
        """Snapshots fetched while the subscription buffers, spliced (bridge.client.bootstrap)."""
        assert self._sub is not None and self.bootstrap is not None
        nc = self._conn.nc
        assert nc is not None
        opts = self.bootstrap
        kv = await open_snapshot_bucket(nc, opts.bucket)
        buffered: list[BusItem] = []
        found: dict[RankKey, Found] = {}
        sub = self._sub

        fetching = True

        async def take_one() -> None:
            """The next message, already queued: never cancelled with one in hand."""
            msg = await sub.next_msg(timeout=None)
            interruption = self._interruption()
            if interruption is not None:
                buffered.append(interruption)
            item = self._decode(msg)
            if item is not None:
                buffered.append(item)

        async def take() -> None:
            while fetching:
                if sub.pending_msgs:
                    await take_one()
                else:
                    await anyio.sleep(_TAKE_POLL_S)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            covered = SubjectFilter(self.subject, opts.prefix)
            wanted = {k for k in await discover(nc, opts, kv) if covered.covers_rank(*k)}
            # Ranks the buffer shows that discovery missed: a second round for them.
            for _ in range(2):
                wanted |= {k for k in map(rank_of, (getattr(b, "body", None) for b in buffered)) if k is not None}
                wanted -= set(found)
                if not wanted:
                    break
                got, sources = await fetch_all(nc, opts, kv, wanted, self.identity)
                found.update(_trimmed(got, covered))
                self.sources.extend(sources)
            fetching = False
        # Each answer came after the last message its snapshot holds, on the
        # same connection: those messages are queued by now, and are cut like
        # the rest of the buffer (left in the queue, they would be applied
        # again after the snapshot: a record too, e.g. a `cleared`).
        for _ in range(sub.pending_msgs):
            await take_one()
        self._gate = LiveGate(found)
        older = {(s.worker, s.dp_rank) for s in self.sources if s.source == "bucket"}
        items = splice_buffer(buffered, found, older, gate=self._gate)
        self.delivered += sum(1 for i in items if type(i) is BusMessage)
        return items  # type: ignore[return-value]

    async def _stream_bootstrap(self) -> api.ConsumerConfig:
        """Snapshots first, then the stream from the oldest of their stream
        sequences (each rank skipping up to its own)."""
        nc = self._conn.nc
        assert nc is not None and self.bootstrap is not None
        opts = self.bootstrap
        kv = await open_snapshot_bucket(nc, opts.bucket)
        covered = SubjectFilter(self.subject, opts.prefix)
        wanted = {k for k in await discover(nc, opts, kv) if covered.covers_rank(*k)}
        found, self.sources = await fetch_all(nc, opts, kv, wanted, self.identity)
        found = _trimmed(found, covered)
        # What the stream still holds after each snapshot: its deletions from
        # the middle as well as its first sequence (bridge.contract.holdings).
        holdings = await stream_holdings(nc.jetstream(), self.stream)
        plan = stream_opening(found, holdings)
        self._opening = list(plan.items)
        self._gate = LiveGate(found, plan.skip_seq, holdings)
        if plan.start_seq is None:
            return consumer_config(StartAt("all"))
        return consumer_config(StartAt("seq", seq=plan.start_seq))

    def _interruption(self) -> Interruption | None:
        if self.since is not None or self._sub is None:
            return None
        disconnects = self._conn.disconnects
        drops = self._conn.slow_consumer_drops[self._sub]
        reason: Literal["disconnect", "slow_consumer"] | None = None
        if disconnects != self._seen_disconnects:
            reason = "disconnect"
        elif drops != self._seen_drops:
            reason = "slow_consumer"
        self._seen_disconnects, self._seen_drops = disconnects, drops
        return Interruption(reason, time.time()) if reason else None

    def _decode(self, msg: Msg) -> BusMessage | None:
        headers = dict(msg.headers) if msg.headers else {}
        if not self.identity.delivered(msg.subject, headers):
            return None
        try:
            body = self._codec.decode(msg.subject, headers, msg.data)
        except BusDecodeError:
            self.undecodable += 1
            return None
        if not self.identity.message(msg.subject, body):
            return None
        stream_seq = msg.metadata.sequence.stream if self.since is not None else None
        return BusMessage(msg.subject, headers, body, time.time(), stream_seq)


def _trimmed(found: dict[RankKey, Found], covered: SubjectFilter) -> dict[RankKey, Found]:
    """Each snapshot with only the groups the subscription will hear of."""
    return {k: covered.trim(v) if type(v) is RankSnapshot else v for k, v in found.items()}
