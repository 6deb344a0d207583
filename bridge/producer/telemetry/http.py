"""The bridge's own endpoints: GET /metrics, /healthz and /readyz, on the
shared small server (`bridge.runtime.http`)."""

from __future__ import annotations

import anyio.abc

from bridge.producer.telemetry.health import Health
from bridge.producer.telemetry.metrics import Metrics
from bridge.runtime.http import Limits, Response
from bridge.runtime.http import serve_http as _serve

# Three GET routes: a request is its head, and a probe or scraper that hangs
# must not hold a connection for long.
LIMITS = Limits(max_head=8192, max_body=0, seconds=5)


async def serve_http(
    host: str, port: int, metrics: Metrics, health: Health, *, task_status: anyio.abc.TaskStatus[int]
) -> None:
    async def handler(method: str, path: str, body: bytes) -> Response:
        return _route(method, path, metrics, health)

    await _serve(host, port, handler, LIMITS, task_status=task_status)


def _route(method: str, path: str, metrics: Metrics, health: Health) -> Response:
    if method != "GET":
        return 405, "text/plain", b"GET only\n"
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.render()
    if path == "/healthz":
        return (200, "text/plain", b"ok\n") if health.live() else (503, "text/plain", b"stalled\n")
    if path == "/readyz":
        if health.ready():
            return 200, "text/plain", b"ready\n"
        why = f"zmq_subscribed={health.zmq_subscribed} nats_connected={health.nats_connected}\n"
        return 503, "text/plain", why.encode()
    return 404, "text/plain", b"not found\n"
