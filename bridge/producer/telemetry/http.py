"""A tiny HTTP/1.1 server for /metrics, /healthz and /readyz.

Three fixed GET routes do not justify a web framework in a sidecar."""

from __future__ import annotations

import anyio
import anyio.abc
import structlog

from bridge.producer.telemetry.health import Health
from bridge.producer.telemetry.metrics import Metrics

log = structlog.get_logger("bridge.http")

_MAX_REQUEST = 8192


async def serve_http(
    host: str, port: int, metrics: Metrics, health: Health, *, task_status: anyio.abc.TaskStatus[int]
) -> None:
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    log.info("http_listening", host=host, port=bound)
    task_status.started(bound)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(5):
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < _MAX_REQUEST:
                        request += await stream.receive(4096)
                    line = request.split(b"\r\n", 1)[0].decode("latin-1")
                    parts = line.split(" ")
                    path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
                    status, ctype, body = _route(parts[0] if parts else "", path, metrics, health)
                    head = (
                        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                    ).encode()
                    await stream.send(head + body)
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError, OSError):
                pass

    await listener.serve(handle)


def _route(method: str, path: str, metrics: Metrics, health: Health) -> tuple[str, str, bytes]:
    if method != "GET":
        return "405 Method Not Allowed", "text/plain", b"GET only\n"
    if path == "/metrics":
        return "200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics.render()
    if path == "/healthz":
        return ("200 OK", "text/plain", b"ok\n") if health.live() else ("503 Service Unavailable", "text/plain", b"stalled\n")
    if path == "/readyz":
        if health.ready():
            return "200 OK", "text/plain", b"ready\n"
        why = f"zmq_subscribed={health.zmq_subscribed} nats_connected={health.nats_connected}\n"
        return "503 Service Unavailable", "text/plain", why.encode()
    return "404 Not Found", "text/plain", b"not found\n"
