"""What /healthz and /readyz answer."""

from __future__ import annotations

import time


class Health:
    """Liveness is the bridge's own loop ticking, and NATS usable within
    `nats_unhealthy_after_s` (0: no bound): a bridge that cannot reach NATS
    for that long is better restarted by its orchestrator. Readiness is every
    ZMQ subscription up and NATS connected, the JetStream stream answering
    (in JetStream mode), and no permission violation reported lately."""

    def __init__(self, stale_after_s: float = 10.0, nats_unhealthy_after_s: float = 0.0) -> None:
        self._stale_after_s = stale_after_s
        self._nats_unhealthy_after_s = nats_unhealthy_after_s
        self._last_tick = time.monotonic()
        self.zmq_subscribed = False
        self._nats_connected = False
        # Since when NATS has been unusable (monotonic; None: it is usable).
        # From the start: a NATS never reached is as unusable as one lost.
        self.nats_down_since: float | None = time.monotonic()
        # False while the stream (or its resume point) does not answer yet.
        self.stream_ready = True
        # Not ready until then (monotonic): the server refused one of our
        # publishes or subscriptions for want of permission.
        self.denied_until = 0.0

    @property
    def nats_connected(self) -> bool:
        return self._nats_connected

    @nats_connected.setter
    def nats_connected(self, value: bool) -> None:
        if value:
            self.nats_down_since = None
        elif self._nats_connected or self.nats_down_since is None:
            self.nats_down_since = time.monotonic()
        self._nats_connected = value

    def tick(self) -> None:
        self._last_tick = time.monotonic()

    def nats_down_for(self) -> float:
        """Seconds NATS has been unusable (0.0 while it is usable)."""
        since = self.nats_down_since
        return 0.0 if since is None else time.monotonic() - since

    def live(self) -> bool:
        now = time.monotonic()
        if now - self._last_tick >= self._stale_after_s:
            return False
        limit = self._nats_unhealthy_after_s
        return not (limit and self.nats_down_for() > limit)

    def permitted(self) -> bool:
        return time.monotonic() >= self.denied_until

    def ready(self) -> bool:
        return self.live() and self.zmq_subscribed and self.nats_connected and self.stream_ready and self.permitted()
