"""`kv-bridge observe`'s HTTP/1.1 server: /metrics, /healthz, /readyz,
GET /v1/workers and POST /v1/prefix (JSON). One request per connection, bodies
by Content-Length only, bounded in size and time: the API is for routers on a
cluster network, not a general web server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import structlog

log = structlog.get_logger("bridge.apps.fleet.http")

MAX_HEAD = 16 * 1024
MAX_BODY = 16 * 1024 * 1024  # a 1M-token prompt as JSON ints
Response = tuple[int, str, bytes]
Handler = Callable[[str, str, bytes], Awaitable[Response]]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


async def _read_request(stream: anyio.abc.SocketStream) -> tuple[str, str, bytes] | Response:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            return 413, "text/plain", b"request head too large\n"
        data += await stream.receive(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2:
        return 400, "text/plain", b"bad request line\n"
    method, path = parts[0], parts[1].split("?", 1)[0]
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                return 400, "text/plain", b"bad Content-Length\n"
        elif name.strip().lower() == "transfer-encoding":
            return 411, "text/plain", b"send a Content-Length\n"
    if length < 0 or length > MAX_BODY:
        return 413, "text/plain", b"body too large\n"
    while len(body) < length:
        body += await stream.receive(min(65536, length - len(body)))
    return method, path, body[:length]


async def serve_http(host: str, port: int, handler: Handler, *, task_status: anyio.abc.TaskStatus[int]) -> None:
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
    log.info("http_listening", host=host, port=bound)
    task_status.started(bound)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(30):
                    req = await _read_request(stream)
                    if len(req) == 3 and isinstance(req[0], str):
                        method, path, body = req  # type: ignore[misc]
                        try:
                            status, ctype, out = await handler(method, path, body)
                        except Exception:  # one bad request must not take the server down
                            log.exception("http_handler_failed", path=path)
                            status, ctype, out = 500, "text/plain", b"internal error\n"
                    else:
                        status, ctype, out = req  # type: ignore[misc]
                    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {ctype}\r\n"
                            f"Content-Length: {len(out)}\r\nConnection: close\r\n\r\n").encode()
                    await stream.send(head + out)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, TimeoutError, OSError):
                pass

    await listener.serve(handle)
