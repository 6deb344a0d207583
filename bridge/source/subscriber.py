"""The SUB side of one vLLM publisher (one data-parallel rank)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq

from bridge.source.zmq_io import drain, wait_readable

DRAIN_LIMIT = 1024


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
        """Everything queued right now, as one list; waits only when empty."""
        while True:
            messages = drain(self._sock, DRAIN_LIMIT)
            if messages:
                yield messages
            else:
                await wait_readable(self._sock)

    def close(self) -> None:
        self._sock.close(linger=0)
