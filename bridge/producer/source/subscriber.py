"""The SUB side of one vLLM publisher (one data-parallel rank)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio.lowlevel
import structlog
import zmq

from bridge.producer.source.zmq_io import InputWatch, drain, readable, wait_readable

log = structlog.get_logger("bridge.subscriber")

# One drained chunk is processed without yielding to the event loop; then the
# sink gets its turn. Bounded by count and by bytes, so that neither many
# small batches nor a few huge ones hold the loop (and fill the queue) for long.
DRAIN_LIMIT = 256
DRAIN_BYTES = 2 * 1024 * 1024


class Subscriber:
    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str, rcvhwm: int, coalesce_s: float = 0.0,
        max_message_bytes: int = -1, watch: InputWatch | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._coalesce_s = coalesce_s
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # Reconnect quickly when the vLLM process comes back, but not in a tight loop.
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        # libzmq does not reconnect after cutting off a message past
        # MAXMSGSIZE (a protocol error): disconnections are watched, and the
        # connection made again by hand once the stream is quiet.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._watch = watch
        if watch is not None:
            watch.add(self._sock)

    async def batches(self) -> AsyncIterator[list[list[bytes]]]:
        """Everything queued right now (up to a budget), as one list; waits
        only when empty. After each chunk the loop is yielded: a steady stream
        of ZMQ messages must never starve the NATS sink, or the bounded queue
        between them overflows although NATS keeps up."""
        sock = self._sock
        coalesce = self._coalesce_s
        clock = time.monotonic
        last = -coalesce
        while True:
            messages = drain(sock, DRAIN_LIMIT, DRAIN_BYTES)
            if messages:
                now = clock()
                trickle = now - last < coalesce
                last = now
                yield messages
                # Batches coming one by one faster than --coalesce-ms: let the
                # next few gather, so they cost one wakeup and one NATS write
                # (here, in nats-server and in every subscriber) instead of one
                # each. Slower streams never wait; a backlog never waits either.
                if trickle:
                    if readable(sock):
                        await anyio.lowlevel.checkpoint()
                    else:
                        await anyio.sleep(coalesce)
                    continue
            # Ask the socket before draining again: an empty drain costs a
            # raised zmq.Again, which under steady load is every other call.
            if await wait_readable(sock):
                await anyio.lowlevel.checkpoint()
            else:
                self._reconnect_if_cut_off()

    def _reconnect_if_cut_off(self) -> None:
        disconnected = False
        try:
            while True:
                self._monitor.recv_multipart(zmq.NOBLOCK)
                disconnected = True
        except zmq.Again:
            pass
        if disconnected:
            log.warning("zmq_reconnect", endpoint=self.endpoint)
            self._sock.disconnect(self.endpoint)
            self._sock.connect(self.endpoint)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.remove(self._sock)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
