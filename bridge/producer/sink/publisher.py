"""Publishes queued batches to NATS, core or JetStream, in queue order.

Both modes hand the queued batches to the connection in one write (how, fast
or by nats-py's public API, is bridge.producer.sink.nats_fastpath's business): no round
trip or future per message. JetStream messages carry a reply subject; the acks
come back to an AckWindow of at most --js-max-pending messages.

JetStream order. A stream leader stores one connection's messages in the order
they come, so the bridge's order holds as long as no message is lost on the
way while a newer one is stored. At the first sign of a lost ack (none for
`stall_s`, an error reply, an ack that overtook an older unacked message, a
reconnect) the sink stops sending newer messages and sends the oldest unacked
one again, alone, until it is stored (a stream between leaders stores
nothing, so this waits the election out); then everything still unacked that
went out before it, in order, in one write; then newer messages again. Copies
sent again carry the same Nats-Msg-Id (and token), which the stream
de-duplicates. What a new leader stored before the sink could know (messages
in flight when it took over) is found from the acks' stream sequences
(bridge.producer.sink.acks) and named by a `gap` record, reason `reordered`.

A message the stream refuses is tried again a few times, then given up:
counted, logged, and its batch named by a `gap` record, so that one message
the stream will never take cannot hold up every later one. A publish the
server's permissions forbid is given up at once (JetStream) and reported:
one log line per subject, a metric, /readyz false.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import nats
import nats.errors
import nats.js
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient

from bridge.producer.config import Settings
from bridge.producer.sink.ack_errors import NoResponders, NoStream, PermissionRefused, PublishRefusal
from bridge.producer.sink.acks import AckWindow, Pending, Sent, Settled, Trouble
from bridge.producer.sink.confirm import Unconfirmed, WrittenRun
from bridge.producer.sink.encode import Outgoing
from bridge.producer.sink.nats_fastpath import select_path
from bridge.producer.sink.queue import BatchQueue, OutBatch
from bridge.producer.sink.stream_setup import StreamState, stream_state
from bridge.producer.telemetry.health import Health
from bridge.producer.telemetry.metrics import Metrics
from bridge.runtime.access import connect_options
from bridge.runtime.nats_barrier import flushed

log = structlog.get_logger("bridge.nats")

_CONNECT_ATTEMPT_S = 5.0

# One write gathers the queued batches up to these bounds.
_WRITE_BYTES = 1024 * 1024
_WRITE_BATCHES = 512

# Answers from the stream that it will not store a message, counted per
# message; at this many the message is given up (four tries after the first
# refusal, 0.1 to 0.8 s apart: 1.5 s in all).
_MAX_REFUSALS = 5

# No ack at all for this long (or --js-ack-timeout if shorter), with messages
# in flight, is taken for a lost one. Far below a stream's leader election
# (nats-server waits 4 to 9 s before it elects a new one), so the sink stops
# sending before a new leader could store newer messages ahead of the lost.
_STALL_S = 1.0

# A PING to the server the sink is connected to must be answered within this,
# or the connection is dropped for another server of the cluster.
_PING_S = 2

# Core mode: how often the server is asked (PING) to confirm what it has
# read, and a wait for its answer longer than any connection lives unanswered
# (nats-py drops a connection after three unanswered pings, 10 s apart).
_CONFIRM_S = 1.0
_CONFIRM_WAIT_S = 3600

# How long a permission violation keeps /readyz false, and how often it is
# logged per subject.
_DENIED_HOLD_S = 30.0

_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"([^\"]+)\"", re.IGNORECASE)

_RETRYABLE = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.APIError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.TooManyStalledMsgsError,
    TimeoutError,
    OSError,
)


def _no_refusal_handler(batch: OutBatch) -> None:
    return None


def _no_reorder_handler(batches: list[OutBatch]) -> None:
    return None


def _no_loss_handler(run: WrittenRun) -> None:
    return None


class NatsSink:
    """`on_refused` names a batch whose message the stream refused for good;
    `on_reordered` the batches the stream stored after a later batch of the
    same worker and rank. `fast_path=False` keeps to nats-py's public API
    whatever nats-py is installed."""

    def __init__(
        self,
        settings: Settings,
        queue: BatchQueue,
        metrics: Metrics,
        health: Health,
        *,
        on_refused: Callable[[OutBatch], None] = _no_refusal_handler,
        on_reordered: Callable[[list[OutBatch]], None] = _no_reorder_handler,
        on_lost: Callable[[WrittenRun], None] = _no_loss_handler,
        on_written: Callable[[list[Outgoing], int], None] | None = None,
        on_stored: Callable[[Outgoing, bytes], None] | None = None,
        fast_path: bool = True,
    ) -> None:
        self._settings = settings
        self._queue = queue
        self._metrics = metrics
        self._health = health
        self.nc: NatsClient | None = None
        self.js: nats.js.JetStreamContext | None = None
        self._connected = anyio.Event()
        self._acks = AckWindow()
        # +1 per reconnect: an ack owed from an earlier connection never comes.
        self._generation = 0
        self.published_batches = 0
        self._last_seq: dict[int, Any] = {}
        self._closing = False
        metrics.watch_in_flight(self.in_flight)
        self._on_refused = on_refused
        self._on_reordered = on_reordered
        self._on_lost = on_lost
        # Set when nats-py closes the current client for good (not by us).
        self._closed = anyio.Event()
        self._unconfirmed = Unconfirmed()
        self.clients_replaced = 0
        # What consumers will see, for the bridge's own residency: in core mode
        # each batch once written (with the number of batches its write held),
        # in JetStream mode each message once stored.
        self._on_written = on_written if not settings.jetstream else None
        self._on_stored = on_stored
        self._path = select_path(fast_path)
        self._last_refused: OutBatch | None = None
        self.stall_s = min(settings.js_ack_timeout, _STALL_S)
        # The ack count last seen, and when it last moved.
        self._seen_acked = 0
        self._progress_at = time.monotonic()
        # Subject → when its violation was last logged.
        self._denied: dict[str, float] = {}
        self.recoveries = 0

    @property
    def write_path(self) -> str:
        """`fast` or `public`: how messages cross nats-py (bridge.producer.sink.nats_fastpath)."""
        return self._path.name

    def in_flight(self) -> tuple[int, int]:
        """JetStream publishes not yet acked: (messages, encoded bytes)."""
        return len(self._acks), self._acks.bytes

    # -- connection ------------------------------------------------------

    async def _on_disconnect(self) -> None:
        if self._closing:
            return
        nc = self.nc
        if self._settings.jetstream and nc is not None:
            # What nats-py still holds of ours would go to the next server
            # first, ahead of what the lost socket took with it: the ack
            # window sends all of it again, oldest first, instead.
            self._path.drop_pending(nc)
        if len(self._acks):
            # Hold newer messages from now on, not from the reconnect callback:
            # nats-py reports itself connected one PING round trip before
            # that callback runs, and a batch published in between would be
            # stored ahead of the ones the lost connection took with it.
            self._acks.trouble = Trouble.RECONNECTED
        self._metrics.nats_disconnects.inc()
        self._metrics.nats_connected.set(0)
        self._health.nats_connected = False
        self._connected = anyio.Event()
        log.warning("nats_disconnected")

    async def _on_reconnect(self) -> None:
        self._generation += 1
        if len(self._acks):
            # What went out on the lost connection may be lost with it.
            self._acks.trouble = Trouble.RECONNECTED
        if self._health.denied_until == float("inf"):
            self._health.denied_until = 0.0  # the subscriptions are made again: a refusal shows again
        self._metrics.nats_reconnects.inc()
        self._metrics.nats_connected.set(1)
        self._health.nats_connected = True
        self._connected.set()
        log.info("nats_reconnected", server=self._server())

    async def _on_error(self, exc: Exception) -> None:
        detail = str(exc)
        found = _VIOLATION.search(detail)
        if found is not None:
            self._permission_denied(found.group(1).lower(), found.group(2), detail)
            return
        log.warning("nats_error", error=type(exc).__name__, detail=detail[:200])

    def _permission_denied(self, operation: str, subject: str, detail: str) -> None:
        """The server's permissions forbid one of our publishes or subscriptions:
        said once per subject and hold time, counted, /readyz false. A
        JetStream publish it forbids is given up at once (it would never be
        acked and would hold up every later one)."""
        now = time.monotonic()
        operation = "publish" if operation == "publish" else "subscribe"
        self._metrics.nats_permission_denied.labels(operation).inc()
        ours = self._acks.inbox and subject.startswith(self._acks.inbox.lower())
        hold = float("inf") if operation == "subscribe" and ours else now + _DENIED_HOLD_S
        self._health.denied_until = max(self._health.denied_until, hold)
        key = subject.lower()  # nats-py lowers the server's error lines
        last = self._denied.get(key)
        if last is None or now - last >= _DENIED_HOLD_S:
            if len(self._denied) > 1024:
                self._denied.clear()
            self._denied[key] = now
            log.error("nats_permission_denied", operation=operation, subject=subject, violation=detail[:300],
                      worker=self._settings.worker_id,
                      hint=self._denial_hint(operation, key))
        if operation == "publish" and self._settings.jetstream:
            token = self._acks.first_with_subject(subject)
            if token is not None:
                entry = self._acks.give_up(token)
                if entry is not None:
                    # Its gap record goes to the worker subject: pointless (and
                    # one more refusal) when that one is forbidden too.
                    worker_subject = f"{key.rsplit('.', 1)[0]}.worker"
                    self._give_up(entry.msg, entry.origin, PermissionRefused(), quiet=True,
                                  announce=not self.denied(worker_subject))

    def _denial_hint(self, operation: str, subject: str) -> str:
        if operation != "publish":
            return "the NATS user may not subscribe to this subject (the bridge needs _INBOX.> for replies)"
        if subject.startswith(("$js.", "$kv.")):
            return "the NATS user may not make this JetStream call (docs/security.md lists what the bridge needs)"
        return (f"the NATS user may not publish this worker's subjects: it needs "
                f"{self._settings.subject_prefix}.<worker>.> for the worker and each of its ranks")

    def denied(self, subject: str) -> bool:
        """Has the server refused us `subject` for want of permission lately?"""
        when = self._denied.get(subject.lower())
        return when is not None and time.monotonic() - when < _DENIED_HOLD_S

    def _server(self) -> str:
        if self.nc is None or self.nc.connected_url is None:
            return ""
        url = self.nc.connected_url
        return f"{url.scheme}://{url.hostname}:{url.port}"

    async def connect(self) -> None:
        """Tries until NATS answers: the ZMQ side keeps buffering meanwhile."""
        opts = connect_options(
            self._settings, f"kv-bridge {self._settings.worker_id}",
            self._on_disconnect, self._on_reconnect, self._on_error,
        )
        closed = self._closed = anyio.Event()

        async def on_closed() -> None:
            if not self._closing:
                closed.set()

        opts["closed_cb"] = on_closed
        delay = 0.2
        while True:
            try:
                # Bounded: nats-py 2.16 can wait forever on a failed TLS handshake
                # (nats-io/nats.py#718); a fresh client on the next attempt recovers.
                with anyio.fail_after(_CONNECT_ATTEMPT_S):
                    nc = self._path.new_client()
                    await nc.connect(**opts)
                    self.nc = nc
                break
            except Exception as exc:  # nats-py raises many kinds here; all mean "not yet"
                log.warning("nats_connect_failed", error=type(exc).__name__, detail=str(exc)[:200], retry_in=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if self._settings.jetstream:
            self.js = nc.jetstream()
            # Acks for the window's reply subjects; nats-py re-subscribes after
            # a reconnect, and a client that replaces a closed one takes the
            # same inbox, so acks owed to the window still find it.
            if not self._acks.inbox:
                self._acks = AckWindow(nc.new_inbox(), self._on_stored)
            await self._path.route_acks(nc, self._acks.inbox, self._acks.on_ack)
        self._metrics.nats_connected.set(1)
        self._health.nats_connected = True
        self._connected.set()
        log.info("nats_connected", server=self._server(), jetstream=self._settings.jetstream)

    async def supervise(self, on_replaced: Callable[[], Awaitable[None]]) -> None:
        """Replaces a client nats-py closed for good (any server -ERR but a
        permission error closes it: a reply over max_payload, an authorization
        change) with a new connection, with backoff, then `on_replaced` makes
        again what lived on the old one. JetStream: the ack window sends its
        unacked messages again, oldest first. Core: what the old client may
        have taken with it is named by gap records. Until cancelled."""
        while True:
            await self._closed.wait()
            nc = self.nc
            error = nc.last_error if nc is not None else None
            began = time.monotonic()
            self._metrics.nats_connected.set(0)
            self._health.nats_connected = False
            self._connected = anyio.Event()
            log.error("nats_client_closed", server=self._server(), error=type(error).__name__ if error else None,
                      detail=str(error)[:200] if error else None, unacked=len(self._acks),
                      hint="the NATS client was closed for good: connecting a new one")
            if not self._settings.jetstream:
                for run in self._unconfirmed.take():
                    self._on_lost(run)
            self._generation += 1
            if len(self._acks):
                self._acks.trouble = Trouble.RECONNECTED
            await self.connect()
            self.clients_replaced += 1
            self._metrics.nats_clients_replaced.inc()
            await on_replaced()
            log.warning("nats_client_replaced", server=self._server(), down_s=round(time.monotonic() - began, 3),
                        replaced=self.clients_replaced)

    async def confirm(self) -> None:
        """Core mode: asks the server every `_CONFIRM_S` to confirm (PONG)
        what it has read, so only what was written since is in doubt when a
        client is closed for good. Until cancelled.

        One PING at a time, never given up: nats-py answers a PONG by setting
        the oldest waiting future, and one cancelled by a timeout makes its
        reader fail and drop the connection (and with it, in core mode, what
        the socket held). A frozen server is nats-py's own to detect."""
        asking: asyncio.Future[None] | None = None
        asked_on: tuple[NatsClient | None, int] = (None, -1)
        asked_at = 0.0
        mark = 0
        while True:
            await anyio.sleep(0.1)
            if asking is not None:
                if asking.done():
                    if not asking.cancelled() and asking.exception() is None:
                        self._unconfirmed.confirm(mark)
                    asking = None
                elif asked_on != (self.nc, self._generation):
                    asking = None  # nats-py forgets a lost connection's pings: so does this
                else:
                    continue
            nc = self.nc
            now = time.monotonic()
            if nc is None or not nc.is_connected or now - asked_at < _CONFIRM_S:
                continue
            asked_at, asked_on = now, (nc, self._generation)
            mark = self._unconfirmed.mark()
            asking = asyncio.ensure_future(nc.flush(timeout=_CONFIRM_WAIT_S))

    # -- publishing ------------------------------------------------------

    async def run(self) -> None:
        """Publishes until cancelled."""
        queue = self._queue
        metrics = self._metrics
        acks = self._acks
        js = self._settings.jetstream
        while True:
            if js and acks.trouble is not None and not len(acks):
                acks.trouble = None  # what was in doubt is settled or given up
            if js and len(acks):
                # Acks outstanding: a quiet queue must not leave a lost one unnoticed.
                reason = self._lost_ack(time.monotonic())
                if reason is not None:
                    try:
                        await self._recover(reason)
                    except _RETRYABLE as exc:
                        acks.trouble = acks.trouble or reason  # not over: pause on
                        metrics.publish_errors.inc()
                        log.warning("publish_retry", error=type(exc).__name__, detail=str(exc)[:200])
                        await anyio.sleep(0.1)
                    continue
                self._announce_reordered()
                with anyio.move_on_after(0.05):
                    await queue.wait()
            else:
                if js:
                    self._announce_reordered()
                await queue.wait()
            batch = queue.peek()
            if batch is None:
                continue
            if not self._usable():
                await self._connected.wait()
                continue
            try:
                if js:
                    if acks.trouble is not None:
                        continue
                    if len(acks) >= self._settings.js_max_pending or acks.bytes >= self._settings.js_max_pending_bytes:
                        # Let acks catch up to half the window, then publish on
                        # in bulk: one write per many messages.
                        waited = time.monotonic()
                        await acks.wait_below(
                            self._settings.js_max_pending // 2, 0.05, self._settings.js_max_pending_bytes // 2
                        )
                        metrics.js_window_waits.value += 1
                        metrics.js_window_wait_s.value += time.monotonic() - waited
                        continue
                await self._publish(batch)
            except _RETRYABLE as exc:
                metrics.publish_errors.inc()
                log.warning("publish_retry", error=type(exc).__name__, detail=str(exc)[:200])
                await anyio.sleep(0.1)
                continue
            metrics.queue_depth.set(len(queue))

    def _usable(self) -> bool:
        """Connected, and the sink's own reconnect handling done (nats-py
        reports itself connected a PING round trip before it calls it)."""
        nc = self.nc
        return nc is not None and nc.is_connected and self._connected.is_set()

    def _lost_ack(self, now: float) -> Trouble | None:
        """Why the window's oldest message may be lost (None: no sign of it)."""
        acks = self._acks
        if acks.trouble is not None:
            return acks.trouble
        progress = acks.progress
        if progress != self._seen_acked:
            self._seen_acked = progress
            self._progress_at = now
            return None
        head = acks.head()
        if head is not None and now - max(self._progress_at, head[1].sent) >= self.stall_s:
            return Trouble.NO_ACK
        return None

    async def _publish(self, first: OutBatch) -> None:
        """Every batch queued now (within bounds and, for JetStream, the ack
        window's room), as one write of HPUB frames into nats-py's pending
        buffer. Batches leave the queue before the await, so an overflow while
        NATS is frozen can only drop batches that were never handed over."""
        nc = self.nc
        assert nc is not None
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        queue = self._queue
        if self._settings.jetstream:
            room = self._settings.js_max_pending - len(self._acks)
            byte_room = min(_WRITE_BYTES, self._settings.js_max_pending_bytes - self._acks.bytes)
        else:
            room, byte_room = 1 << 30, _WRITE_BYTES
        batches = [first]
        queue.pop()
        # nbytes: the queue sized every batch it holds.
        size = first.nbytes
        count = len(first.messages)
        while size < byte_room and len(batches) < _WRITE_BATCHES and count < room:
            batch = queue.peek()
            if batch is None:
                break
            queue.pop()
            batches.append(batch)
            count += len(batch.messages)
            size += batch.nbytes
        try:
            await self._write(nc, [(m, b) for b in batches for m in b.messages])
        except BaseException:
            # Not handed over (outbound buffer full, connection closing): back
            # to the head of the queue, in order, for the retry.
            queue.requeue(batches)
            raise
        if not self._settings.jetstream:
            self._unconfirmed.note(batches)
        self._account(batches)

    async def _write(self, nc: NatsClient, sent: list[Sent]) -> None:
        """The messages in one write on the connection; in JetStream mode each
        registered in the ack window with its reply subject."""
        messages = [m for m, _ in sent]
        replies: list[str] | None = None
        if self._settings.jetstream:
            acks = self._acks
            generation = self._generation
            now = time.monotonic()
            replies = [acks.reply_to(m, generation, now, b) for m, b in sent]
        try:
            await self._path.write(nc, messages, replies)
        except BaseException:
            if replies:
                self._acks.forget_since(replies[0])
            raise

    async def _write_again(self, nc: NatsClient, tokens: list[int]) -> None:
        """Unacked messages again, same tokens and Nats-Msg-Ids, in this order, in one write."""
        messages, replies = self._acks.resend(tokens, self._generation, time.monotonic())
        if messages:
            await self._path.write(nc, messages, replies)

    # -- a lost ack ------------------------------------------------------

    async def _recover(self, reason: Trouble) -> None:
        """Nothing newer goes out until the oldest unacked message is stored:
        it alone, again and again (each try waits `stall_s` for its ack),
        refusals counted and given up after a few; then every unacked message
        sent before it, in order, in one write."""
        acks = self._acks
        began = time.monotonic()
        self.recoveries += 1
        self._metrics.js_recoveries.inc()
        head = acks.head()
        log.warning("js_publish_paused", reason=reason.value, stall_s=self.stall_s, unacked=len(acks),
                    first=head[1].msg.subject if head else None, server=self._server())
        tries = 0
        delay = 0.1
        said = began
        resent = 0
        # Silence may be the connected server's own (frozen, cut off): ask it first.
        check_server = reason is Trouble.NO_ACK
        while True:
            acks.trouble = None
            head = acks.head()
            if head is None:
                break
            token, entry = head
            nc = self.nc
            if nc is None or not self._usable():
                with anyio.move_on_after(self.stall_s):
                    while not self._usable():
                        await anyio.sleep(0.02)
                continue
            if check_server:
                check_server = False
                if not await self._server_answers(nc):
                    log.warning("nats_server_unresponsive", server=self._server(), waited_s=_PING_S)
                    self._connected = anyio.Event()
                    await self._path.drop_connection(nc)
                    continue
            if entry.error is not None:
                if await self._refused_for_good(entry):
                    acks.give_up(token)
                    self._give_up(entry.msg, entry.origin, entry.error)
                    delay = 0.1
                    continue
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
            probe_wire = acks.wire
            await self._write_again(nc, [token])
            tries += 1
            outcome = await acks.wait_settled(token, self.stall_s)
            if outcome is Settled.STORED:
                # Acks come in order: whatever went out before it and is still
                # unacked was lost on the way.
                rest = [t for t, e in acks.unsettled() if e.wire < probe_wire]
                await self._write_again(nc, rest)
                resent = len(rest)
                break
            if outcome is Settled.TIMEOUT:
                check_server = True
                now = time.monotonic()
                if now - said >= 10:
                    said = now
                    log.warning("js_publish_still_paused", paused_s=round(now - began, 1), tries=tries,
                                unacked=len(acks), first=entry.msg.subject)
        self._seen_acked, self._progress_at = acks.progress, time.monotonic()
        log.info("js_publish_resumed", paused_s=round(time.monotonic() - began, 3), tries=tries, resent=resent)

    async def _server_answers(self, nc: NatsClient) -> bool:
        """Does the server we are connected to answer a PING? (A stream without
        a leader stores nothing, but its servers still answer.)"""
        try:
            await nc.flush(timeout=_PING_S)
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    async def _refused_for_good(self, entry: Pending) -> bool:
        """Counts the server's refusal of the oldest message, unless it only
        says that nobody stores anything right now; True once it is given up."""
        error = entry.error
        assert error is not None
        if isinstance(error, NoResponders):
            # No responder on the subject: no stream (deleted? it is made
            # again), one whose subjects no longer cover ours, or one whose
            # leader is being elected.
            assert self.js is not None
            state = await stream_state(self.js, self._settings)
            if state in (StreamState.PRESENT, StreamState.UNAVAILABLE):
                return False
            error = entry.error = NoStream(made_again=state is StreamState.CREATED)
        elif not error.counts:
            return False
        entry.refusals += 1
        self._metrics.publish_errors.inc()
        log.warning("js_publish_retry", subject=entry.msg.subject, refusals=entry.refusals,
                    refusal=type(error).__name__, error=error.detail[:200])
        return entry.refusals >= _MAX_REFUSALS

    def _give_up(self, msg: Outgoing, origin: OutBatch | None, error: PublishRefusal, quiet: bool = False,
                 announce: bool = True) -> None:
        self._metrics.js_refused.inc()
        if not quiet:
            log.error("js_publish_refused", subject=msg.subject, attempts=_MAX_REFUSALS,
                      refusal=type(error).__name__, error=error.detail[:200],
                      seq=None if origin is None or origin.seq < 0 else origin.seq)
        # One gap per batch, however many of its group messages were refused.
        if announce and origin is not None and origin.seq >= 0 and origin is not self._last_refused:
            self._last_refused = origin
            self._on_refused(origin)

    def _announce_reordered(self) -> None:
        batches = self._acks.take_reordered()
        if batches:
            self._metrics.js_reordered.inc(len(batches))
            self._on_reordered(batches)

    def _account(self, batches: list[OutBatch]) -> None:
        metrics = self._metrics
        self.published_batches += len(batches)
        messages_out = metrics.messages_out_by
        events_out = metrics.events_out_by
        lag = metrics.lag
        now = time.time()
        vllm_batches = 0
        written = self._on_written
        in_write = len(batches)
        for batch in batches:
            if written is not None:
                written(batch.messages, in_write)
            for msg in batch.messages:
                family = msg.family
                messages_out[family].value += 1
                if msg.events:
                    events_out[family].value += msg.events
            if batch.seq >= 0:
                vllm_batches += 1
                lag.observe(max(0.0, now - batch.vllm_ts))
                child = self._last_seq.get(batch.dp_rank)
                if child is None:
                    child = self._last_seq[batch.dp_rank] = metrics.last_seq[str(batch.dp_rank)]
                child.value = batch.seq
        if vllm_batches:
            metrics.batches_out.inc(vllm_batches)

    # -- shutdown --------------------------------------------------------

    async def flush(self) -> None:
        """Everything queued out, JetStream acks in, and read by nats-server.
        The publishing task (run) does the work, a lost ack's recovery included."""
        while len(self._queue) or len(self._acks):
            await anyio.sleep(0.01)
        self._announce_reordered()
        if self.nc is not None and self.nc.is_connected:
            try:
                await flushed(self.nc, timeout=5)
            except (nats.errors.Error, TimeoutError) as exc:  # lost on the way out: nothing more to do
                log.warning("nats_flush_failed", error=type(exc).__name__)

    async def close(self) -> None:
        if self.nc is None:
            return
        self._closing = True
        try:
            if self.nc.is_connected:
                await self.nc.drain()
            else:
                await self.nc.close()
        except Exception as exc:  # closing is best effort: the process is ending
            log.warning("nats_close_failed", error=type(exc).__name__)
