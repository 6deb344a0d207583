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
from bridge.sink.encode import Outgoing
from bridge.sink.queue import BatchQueue, OutBatch

log = structlog.get_logger("bridge.nats")

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
        self._window: deque[tuple[Any, Outgoing]] = deque()
        self.published_batches = 0
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
                self.nc = await nats.connect(**opts)
                break
            except Exception as exc:  # nats-py raises many kinds here; all mean "not yet"
                log.warning("nats_connect_failed", error=type(exc).__name__, detail=str(exc)[:200], retry_in=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if self._settings.jetstream:
            self.js = self.nc.jetstream(publish_async_max_pending=self._settings.js_max_pending)
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
            await queue.wait()
            metrics.queue_depth.set(len(queue))
            batch = queue.peek()
            if batch is None:
                continue
            if self.nc is None or not self.nc.is_connected:
                await self._connected.wait()
                continue
            try:
                if self.js is not None:
                    await self._publish_js(batch)
                else:
                    await self._publish_core(batch)
            except _RETRYABLE as exc:
                metrics.publish_errors.inc()
                log.warning("publish_retry", error=type(exc).__name__, detail=str(exc)[:200])
                await anyio.sleep(0.1)
                continue
            queue.pop()
            self._account(batch)

    async def _publish_core(self, batch: OutBatch) -> None:
        publish = self.nc.publish  # type: ignore[union-attr]
        for msg in batch.messages:
            await publish(msg.subject, msg.payload, headers=msg.headers)

    async def _publish_js(self, batch: OutBatch) -> None:
        js = self.js
        assert js is not None
        for msg in batch.messages:
            future = await js.publish_async(msg.subject, msg.payload, headers=msg.headers, wait_stall=5.0)
            self._window.append((future, msg))
        while len(self._window) > self._settings.js_max_pending:
            await self._settle_oldest()

    async def _settle_oldest(self) -> None:
        future, msg = self._window.popleft()
        try:
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

    def _account(self, batch: OutBatch) -> None:
        metrics = self._metrics
        self.published_batches += 1
        for msg in batch.messages:
            metrics.messages_out_by[msg.family].inc()
            if msg.events:
                metrics.events_out_by[msg.family].inc(msg.events)
        if batch.seq >= 0:
            metrics.batches_out.inc()
            metrics.lag.observe(max(0.0, time.time() - batch.vllm_ts))
            metrics.last_seq.labels(str(batch.dp_rank)).set(batch.seq)
        metrics.queue_depth.set(len(self._queue))

    # -- shutdown --------------------------------------------------------

    async def flush(self) -> None:
        """Everything queued out, JetStream acks in, bytes on the wire."""
        while len(self._queue):
            await anyio.sleep(0.01)
        while self._window:
            await self._settle_oldest()
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
