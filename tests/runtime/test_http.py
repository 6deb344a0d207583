"""The shared small HTTP server (`bridge.runtime.http`) on a real socket: a
request reaches the handler with its body, and what a request may cost is
bounded (head, body, chunked bodies refused), and a failing handler answers
500 without taking the server down."""

from __future__ import annotations

import json

import anyio
import pytest

from bridge.runtime.http import Limits, Response, serve_http

pytestmark = pytest.mark.anyio

LIMITS = Limits(max_head=1024, max_body=4096, seconds=5)


async def _exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(raw)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, payload = data.partition(b"\r\n\r\n")
    assert f"Content-Length: {len(payload)}".encode() in head
    return int(head.split(b" ")[1]), payload


async def _handler(method: str, path: str, body: bytes) -> Response:
    if path == "/boom":
        raise RuntimeError("a handler bug")
    return 200, "text/plain", f"{method} {path} {len(body)}".encode() + b"|" + body


async def test_request_reaches_the_handler_and_bounds_hold() -> None:
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_http, "127.0.0.1", 0, _handler, LIMITS)
        body = b"x" * 4096
        assert await _exchange(port, b"POST /p?q=1 HTTP/1.1\r\nContent-Length: 4096\r\n\r\n" + body) == (
            200, b"POST /p 4096|" + body)
        assert await _exchange(port, b"GET /g HTTP/1.1\r\n\r\n") == (200, b"GET /g 0|")
        # body past the bound: refused before reading it; every refusal a JSON error body
        refusals = [
            (b"POST /p HTTP/1.1\r\nContent-Length: 4097\r\n\r\n", 413),
            # head past the bound, with or without its end
            (b"GET / HTTP/1.1\r\nX: " + b"a" * 2048 + b"\r\n\r\n", 413),
            (b"GET / HTTP/1.1\r\nX: " + b"a" * 70000, 413),
            (b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
            (b"POST /p HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
            (b"NONSENSE\r\n\r\n", 400),
            (b"GET /boom HTTP/1.1\r\n\r\n", 500),
        ]
        for request, status in refusals:
            got, body = await _exchange(port, request)
            assert got == status, request[:40]
            assert isinstance(json.loads(body)["error"], str), body
        assert await _exchange(port, b"GET /boom HTTP/1.1\r\n\r\n") == (500, b'{"error": "internal error"}')
        assert (await _exchange(port, b"GET /after HTTP/1.1\r\n\r\n"))[0] == 200
        tg.cancel_scope.cancel()
