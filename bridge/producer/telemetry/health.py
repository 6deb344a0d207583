"""What /healthz and /readyz answer."""

from __future__ import annotations

import time


class Health:
    """Liveness is the bridge's own loop ticking; readiness is every ZMQ
    subscription up and NATS connected, the JetStream stream answering (in
    JetStream mode), and no permission violation reported lately."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self._stale_after_s = stale_after_s
        self._last_tick = time.monotonic()
        self.zmq_subscribed = False
        self.nats_connected = False
        # False while the stream (or its resume point) does not answer yet.
        self.stream_ready = True
        # Not ready until then (monotonic): the server refused one of our
        # publishes or subscriptions for want of permission.
        self.denied_until = 0.0

    def tick(self) -> None:
        self._last_tick = time.monotonic()

    def live(self) -> bool:
        return time.monotonic() - self._last_tick < self._stale_after_s

    def permitted(self) -> bool:
        return time.monotonic() >= self.denied_until

    def ready(self) -> bool:
        return self.live() and self.zmq_subscribed and self.nats_connected and self.stream_ready and self.permitted()
