"""Publishes queued batches to NATS, core or JetStream, in queue order.

Core NATS: messages go on the connection without a round trip each; nats-py's
flusher writes them out. JetStream: acks are awaited under a bounded window and
a failed one is published again with the same Nats-Msg-Id, which the stream
de-duplicates.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import anyio
import anyio.abc
import nats
import nats.errors
import nats.js
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient

from bridge.config import Settings
from bridge.observe.health import Health
from bridge.observe.metrics import Metrics
from bridge.sink.connection import connect_options
from bridge.sink.encode import Outgoing, hpub_frames
from bridge.sink.queue import BatchQueue, OutBatch

log = structlog.get_logger("bridge.nats")

_CONNECT_ATTEMPT_S = 5.0

# One core-NATS write gathers the queued batches up to these bounds.
_CORE_WRITE_BYTES = 1024 * 1024
_CORE_WRITE_BATCHES = 512

_RETRYABLE = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.APIError,
    nats.js.errors.TooManyStalledMsgsError,
    TimeoutError,
    OSError,
)


class NatsSink:
    def __init__(self, settings: Settings, queue: BatchQueue, metrics: Metrics, health: Health) -> None:
        self._settings = settings
        self._queue = queue
        self._metrics = metrics
        self._health = health
        self.nc: NatsClient | None = None
        self.js: nats.js.JetStreamContext | None = None
        self._connected = anyio.Event()
        # (ack future, message, connection generation it was sent on)
        self._window: deque[tuple[Any, Outgoing, int]] = deque()
        # +1 per reconnect: an ack owed from an earlier connection never comes.
        self._generation = 0
        self.published_batches = 0
        self._last_seq: dict[int, Any] = {}
        self._closing = False

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
                    self.nc = await nats.connect(**opts)
                break
            except Exception as exc:  # nats-py raises many kinds here; all mean "not yet"
                log.warning("nats_connect_failed", error=type(exc).__name__, detail=str(exc)[:200], retry_in=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if self._settings.jetstream:
            # Our window (js_max_pending) is the limit; nats-py's semaphore gets
            # headroom so publish_async never waits on it (see _publish_js).
            self.js = self.nc.jetstream(publish_async_max_pending=2 * self._settings.js_max_pending + 1024)
        self._metrics.nats_connected.set(1)
        self._health.nats_connected = True
        self._connected.set()
        log.info("nats_connected", server=self._server(), jetstream=self._settings.jetstream)

    # -- publishing ------------------------------------------------------

    async def run(self) -> None:
        """Publishes until cancelled."""
        queue = self._queue
        metrics = self._metrics
        while True:
            if self._window:
                # JetStream acks outstanding: a quiet queue must not leave them
                # unsettled (a lost ack is only noticed, and the message
                # republished, when it is settled).
                with anyio.move_on_after(0.05):
                    await queue.wait()
                if not len(queue):
                    await self._settle_window()
                    continue
            else:
                await queue.wait()
            batch = queue.peek()
            if batch is None:
                continue
            if self.nc is None or not self.nc.is_connected:
                await self._connected.wait()
                continue
            if self._window and self._window[0][2] != self._generation:
                # Messages in flight when the connection broke go again first,
                # so the stream keeps the bridge's order.
                await self._settle_window()
                continue
            try:
                if self.js is not None:
                    # Off the queue before the first await: an overflow while
                    # this publish waits can only drop batches not handed over.
                    queue.pop()
                    try:
                        await self._publish_js(batch)
                    except BaseException:
                        queue.requeue([batch])
                        raise
                    self._account([batch])
                else:
                    await self._publish_core(batch)
            except _RETRYABLE as exc:
                metrics.publish_errors.inc()
                log.warning("publish_retry", error=type(exc).__name__, detail=str(exc)[:200])
                await anyio.sleep(0.1)
                continue
            metrics.queue_depth.set(len(queue))

    async def _settle_window(self) -> None:
        while self._window:
            await self._settle_oldest()

    async def _publish_core(self, first: OutBatch) -> None:
        """Every batch queued now, as one write of HPUB frames into nats-py's
        pending buffer (its flusher sends it): no per-message publish() call,
        header encoding or validation. Batches leave the queue before the
        await, so an overflow while NATS is frozen can only drop batches that
        were never handed over."""
        nc = self.nc
        assert nc is not None
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        queue = self._queue
        batches = [first]
        queue.pop()
        size = sum(len(m.payload) for m in first.messages)
        while size < _CORE_WRITE_BYTES and len(batches) < _CORE_WRITE_BATCHES:
            batch = queue.peek()
            if batch is None:
                break
            queue.pop()
            batches.append(batch)
            size += sum(len(m.payload) for m in batch.messages)
        try:
            await nc._send_command(hpub_frames(m for b in batches for m in b.messages))  # noqa: SLF001
        except BaseException:
            # Not handed over (outbound buffer full, connection closing): back
            # to the head of the queue, in order, for the retry.
            queue.requeue(batches)
            raise
        if nc._flush_queue is not None and nc._flush_queue.empty():  # noqa: SLF001 - as nc.publish does
            await nc._flush_pending()  # noqa: SLF001
        self._account(batches)

    async def _publish_js(self, batch: OutBatch) -> None:
        js = self.js
        assert js is not None
        window = self._window
        for msg in batch.messages:
            # wait_stall=None: nats-py wraps a timed semaphore wait in a task and
            # always yields, which makes every message its own socket write.
            future = await js.publish_async(msg.subject, msg.payload, headers=msg.headers)
            window.append((future, msg, self._generation))
        while window and window[0][0].done():
            await self._settle_oldest()
        if len(window) > self._settings.js_max_pending:
            # Let acks catch up to half the window, then publish on in bulk:
            # one write per many messages instead of one per ack.
            while len(window) > self._settings.js_max_pending // 2:
                await self._settle_oldest()

    async def _settle_oldest(self) -> None:
        future, msg, generation = self._window.popleft()
        try:
            if future.done():
                future.result()  # the ack, or the error that replaced it
            elif generation != self._generation:
                raise ConnectionError("sent before a reconnect; its ack is lost")
            else:
                with anyio.fail_after(self._settings.js_ack_timeout):
                    await future
            return
        except Exception as exc:  # a lost or negative ack: publish it again, same Msg-Id
            self._metrics.publish_errors.inc()
            log.warning("js_ack_failed", subject=msg.subject, error=type(exc).__name__)
        await self._republish(msg)

    async def _republish(self, msg: Outgoing) -> None:
        js = self.js
        assert js is not None
        delay = 0.1
        while True:
            if self.nc is None or not self.nc.is_connected:
                await self._connected.wait()
            try:
                await js.publish(msg.subject, msg.payload, timeout=self._settings.js_ack_timeout, headers=msg.headers)
                return
            except _RETRYABLE as exc:
                self._metrics.publish_errors.inc()
                log.warning("js_publish_retry", subject=msg.subject, error=type(exc).__name__)
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _account(self, batches: list[OutBatch]) -> None:
        metrics = self._metrics
        self.published_batches += len(batches)
        messages: dict[str, int] = {}
        events: dict[str, int] = {}
        now = time.time()
        vllm_batches = 0
        for batch in batches:
            for msg in batch.messages:
                family = msg.family
                messages[family] = messages.get(family, 0) + 1
                if msg.events:
                    events[family] = events.get(family, 0) + msg.events
            if batch.seq >= 0:
                vllm_batches += 1
                metrics.lag.observe(max(0.0, now - batch.vllm_ts))
                child = self._last_seq.get(batch.dp_rank)
                if child is None:
                    child = self._last_seq[batch.dp_rank] = metrics.last_seq[str(batch.dp_rank)]
                child.set(batch.seq)
        for family, n in messages.items():
            metrics.messages_out_by[family].inc(n)
        for family, n in events.items():
            metrics.events_out_by[family].inc(n)
        if vllm_batches:
            metrics.batches_out.inc(vllm_batches)

    # -- shutdown --------------------------------------------------------

    async def flush(self) -> None:
        """Everything queued out, JetStream acks in, bytes on the wire."""
        while len(self._queue):
            await anyio.sleep(0.01)
        await self._settle_window()
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
