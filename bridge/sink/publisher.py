"""Publishes queued batches to NATS, core or JetStream, in queue order.

Both modes hand the queued batches to the connection in one write (how, fast
or by nats-py's public API, is bridge.sink.nats_fastpath's business): no round
trip or future per message. JetStream messages carry a reply subject; the acks
come back to an AckWindow of at most --js-max-pending messages, and one that is lost with a
connection or late is published again with the same Nats-Msg-Id, which the
stream de-duplicates. One the stream refuses is tried again a few times, then
given up: counted, logged, and its batch named by a `gap` record, so that one
message the stream will never take cannot hold up every later one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import nats
import nats.errors
import nats.js
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient

from bridge.access import connect_options
from bridge.config import Settings
from bridge.observe.health import Health
from bridge.observe.metrics import Metrics
from bridge.sink.acks import AckWindow, Sent
from bridge.sink.encode import Outgoing
from bridge.sink.jetstream import ensure_stream
from bridge.sink.nats_fastpath import select_path
from bridge.sink.queue import BatchQueue, OutBatch

log = structlog.get_logger("bridge.nats")

_CONNECT_ATTEMPT_S = 5.0

# One write gathers the queued batches up to these bounds.
_WRITE_BYTES = 1024 * 1024
_WRITE_BATCHES = 512

# Answers from the stream that it will not store a message, counted per
# message; at this many the message is given up (four tries after the first
# refusal, 0.1 to 0.8 s apart: 1.5 s in all).
_MAX_REFUSALS = 5

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


class NatsSink:
    """`on_refused` names a batch whose message the stream refused for good.
    `fast_path=False` keeps to nats-py's public API whatever nats-py is installed."""

    def __init__(
        self,
        settings: Settings,
        queue: BatchQueue,
        metrics: Metrics,
        health: Health,
        *,
        on_refused: Callable[[OutBatch], None] = _no_refusal_handler,
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
        self._path = select_path(fast_path)
        self._last_refused: OutBatch | None = None

    @property
    def write_path(self) -> str:
        """`fast` or `public`: how messages cross nats-py (bridge.sink.nats_fastpath)."""
        return self._path.name

    def in_flight(self) -> tuple[int, int]:
        """JetStream publishes not yet acked: (messages, encoded bytes)."""
        return len(self._acks), self._acks.bytes

    # -- connection ------------------------------------------------------

    async def _on_disconnect(self) -> None:
        if self._closing:
            return
        self._metrics.nats_disconnects.inc()
        self._metrics.nats_connected.set(0)
        self._health.nats_connected = False
        self._connected = anyio.Event()
        log.warning("nats_disconnected")

    async def _on_reconnect(self) -> None:
        self._generation += 1
        self._metrics.nats_reconnects.inc()
        self._metrics.nats_connected.set(1)
        self._health.nats_connected = True
        self._connected.set()
        log.info("nats_reconnected", server=self._server())

    async def _on_error(self, exc: Exception) -> None:
        log.warning("nats_error", error=type(exc).__name__, detail=str(exc)[:200])

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
            # Acks for the window's reply subjects; nats-py re-subscribes after a reconnect.
            self._acks = AckWindow(nc.new_inbox())
            await self._path.route_acks(nc, self._acks.inbox, self._acks.on_ack)
        self._metrics.nats_connected.set(1)
        self._health.nats_connected = True
        self._connected.set()
        log.info("nats_connected", server=self._server(), jetstream=self._settings.jetstream)

    # -- publishing ------------------------------------------------------

    async def run(self) -> None:
        """Publishes until cancelled."""
        queue = self._queue
        metrics = self._metrics
        acks = self._acks
        js = self._settings.jetstream
        while True:
            if js and (len(acks) or acks.failed):
                # Acks outstanding or refusals: a quiet queue must not leave a
                # lost, late or refused one unnoticed.
                try:
                    await self._resend_overdue()
                except _RETRYABLE as exc:
                    metrics.publish_errors.inc()
                    log.warning("publish_retry", error=type(exc).__name__, detail=str(exc)[:200])
                    await anyio.sleep(0.1)
                    continue
                with anyio.move_on_after(0.05):
                    await queue.wait()
            else:
                await queue.wait()
            batch = queue.peek()
            if batch is None:
                continue
            if self.nc is None or not self.nc.is_connected:
                await self._connected.wait()
                continue
            try:
                if js:
                    await self._resend_overdue()
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

    async def _resend_overdue(self) -> None:
        """What will not be acked goes again before anything new (the stream
        keeps the bridge's order): messages sent on a connection since lost, or
        unacked past --js-ack-timeout, in one write, back into the window;
        refused ones one by one, each awaiting its ack, with back-off, until
        given up."""
        acks = self._acks
        if not acks.failed and acks.oldest_age(time.monotonic()) < self._settings.js_ack_timeout and (
            not len(acks) or acks.first_generation() == self._generation
        ):
            return
        while acks.failed:
            msg, origin, error = acks.failed.popleft()
            self._metrics.publish_errors.inc()
            log.warning("js_ack_failed", subject=msg.subject, error=error[:200])
            await self._republish(msg, origin, error)
        nc = self.nc
        if nc is None or not nc.is_connected:
            return  # after the reconnect they are owed by an earlier generation and go then
        late = acks.overdue(time.monotonic(), self._settings.js_ack_timeout, self._generation)
        if not late:
            return
        self._metrics.publish_errors.inc(len(late))
        log.warning("js_ack_missing", messages=len(late), first=late[0][0].subject, reason="timeout or reconnect")
        try:
            await self._write(nc, late)
        except BaseException:
            # Not handed over: the slow path, one by one, retries them; not
            # being sent is no refusal, so it does not count towards giving up.
            acks.failed.extend((msg, origin, "") for msg, origin in late)
            raise

    async def _republish(self, msg: Outgoing, origin: OutBatch | None, error: str) -> None:
        """`msg` again, awaiting its ack, until stored or refused
        `_MAX_REFUSALS` times; connection trouble is waited out, not counted.
        `error`: why the server refused it already ("" if it was only not sent)."""
        js = self.js
        assert js is not None
        refusals = 1 if error else 0
        delay = 0.1
        failed = bool(error)
        while refusals < _MAX_REFUSALS:
            if failed:
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)
            if self.nc is None or not self.nc.is_connected:
                await self._connected.wait()
            try:
                await js.publish(msg.subject, msg.payload, timeout=self._settings.js_ack_timeout, headers=msg.headers)
                return
            except nats.js.errors.NoStreamResponseError:
                # No stream takes the subject (deleted by hand?): make it again.
                refusals += 1
                error = why = "no stream takes the subject"
                await self._restore_stream()
            except nats.js.errors.APIError as exc:
                refusals += 1
                error = why = str(exc)
            except _RETRYABLE as exc:
                why = type(exc).__name__
            failed = True
            self._metrics.publish_errors.inc()
            log.warning("js_publish_retry", subject=msg.subject, refusals=refusals, error=why[:200])
        self._give_up(msg, origin, error)

    async def _restore_stream(self) -> None:
        assert self.js is not None
        try:
            await ensure_stream(self.js, self._settings)
        except _RETRYABLE as exc:
            log.warning("stream_restore_failed", stream=self._settings.stream_name, error=type(exc).__name__)

    def _give_up(self, msg: Outgoing, origin: OutBatch | None, error: str) -> None:
        self._metrics.js_refused.inc()
        log.error("js_publish_refused", subject=msg.subject, attempts=_MAX_REFUSALS, error=error[:200],
                  seq=None if origin is None or origin.seq < 0 else origin.seq)
        # One gap per batch, however many of its group messages were refused.
        if origin is not None and origin.seq >= 0 and origin is not self._last_refused:
            self._last_refused = origin
            self._on_refused(origin)

    def _account(self, batches: list[OutBatch]) -> None:
        metrics = self._metrics
        self.published_batches += len(batches)
        messages_out = metrics.messages_out_by
        events_out = metrics.events_out_by
        lag = metrics.lag
        now = time.time()
        vllm_batches = 0
        for batch in batches:
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
        """Everything queued out, JetStream acks in, bytes on the wire."""
        while len(self._queue):
            await anyio.sleep(0.01)
        while len(self._acks) or self._acks.failed:
            await self._resend_overdue()
            await self._acks.wait_below(0, 0.05)
        if self.nc is not None and self.nc.is_connected:
            await self.nc.flush(timeout=5)

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
