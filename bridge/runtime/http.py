"""One small HTTP/1.1 server for the programs' own endpoints (the bridge's
/metrics and health, the fleet service's API): one request per connection,
a body by Content-Length only, head and body bounded in size and the whole
exchange bounded in time. The endpoints are for scrapers, probes and routers
on a cluster network, not for the open web, so a framework would add only
surface."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

log = structlog.get_logger("bridge.runtime.http")

Response = tuple[int, str, bytes]
"""(status, content type, body)."""
Handler = Callable[[str, str, bytes], Awaitable[Response]]
"""Called with (method, path without its query, body)."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_CHUNK = 65536


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server."""

    max_head: int
    """Bytes of request line and headers; past it the answer is 413."""
    max_body: int
    """Bytes a Content-Length may announce; past it the answer is 413."""
    seconds: float
    """The whole exchange, reading to sending; past it the connection closes."""


def error_response(status: int, why: str) -> Response:
    """An error the server answers itself, as every error of the programs'
    endpoints is: a JSON body `{"error": why}`."""
    return (status, "application/json", json.dumps({"error": why}).encode())


class _Refused(Exception):
    """A request answered without reaching the handler."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.response: Response = error_response(status, why)


async def _read_request(stream: anyio.abc.SocketStream, limits: Limits) -> tuple[str, str, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > limits.max_head:
            raise _Refused(413, "request head too large")
        data += await stream.receive(_CHUNK)
    head, _, body = data.partition(b"\r\n\r\n")
    if len(head) > limits.max_head:
        raise _Refused(413, "request head too large")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2:
        raise _Refused(400, "bad request line")
    method, path = parts[0], parts[1].split("?", 1)[0]
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise _Refused(400, "bad Content-Length") from None
        elif name == "transfer-encoding":
            raise _Refused(411, "send a Content-Length")
    if length < 0 or length > limits.max_body:
        raise _Refused(413, "body too large")
    while len(body) < length:
        body += await stream.receive(min(_CHUNK, length - len(body)))
    return method, path, body[:length]


def _encode(response: Response) -> bytes:
    status, ctype, body = response
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def serve_http(
    host: str, port: int, handler: Handler, limits: Limits, *, task_status: anyio.abc.TaskStatus[int]
) -> None:
    """Serves until cancelled; reports the bound port (`port` 0 picks one)
    through `task_status`."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
    log.info("http_listening", host=host, port=bound)
    task_status.started(bound)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(limits.seconds):
                    try:
                        method, path, body = await _read_request(stream, limits)
                    except _Refused as refused:
                        await stream.send(_encode(refused.response))
                        return
                    try:
                        response = await handler(method, path, body)
                    except Exception:  # one bad request must not take the server down
                        log.exception("http_handler_failed", path=path)
                        response = error_response(500, "internal error")
                    await stream.send(_encode(response))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, TimeoutError, OSError):
                pass

    await listener.serve(handle)
