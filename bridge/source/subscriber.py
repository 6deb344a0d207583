"""The SUB side of one vLLM publisher (one data-parallel rank)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio.lowlevel
import zmq

from bridge.source.zmq_io import drain, wait_readable

# One drained chunk is processed without yielding to the event loop; then the
# sink gets its turn. Bounded by count and by bytes, so that neither many
# small batches nor a few huge ones hold the loop (and fill the queue) for long.
DRAIN_LIMIT = 256
DRAIN_BYTES = 2 * 1024 * 1024


class Subscriber:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str, rcvhwm: int) -> None:
        self.endpoint = endpoint
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        # Reconnect quickly when the vLLM process comes back, but not in a tight loop.
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sock.connect(endpoint)

    async def batches(self) -> AsyncIterator[list[list[bytes]]]:
        """Everything queued right now (up to a budget), as one list; waits
        only when empty. After each chunk the loop is yielded: a steady stream
        of ZMQ messages must never starve the NATS sink, or the bounded queue
        between them overflows although NATS keeps up."""
        sock = self._sock
        while True:
            messages = drain(sock, DRAIN_LIMIT, DRAIN_BYTES)
            if messages:
                yield messages
            # Ask the socket before draining again: an empty drain costs a
            # raised zmq.Again, which under steady load is every other call.
            if await wait_readable(sock):
                await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        self._sock.close(linger=0)
