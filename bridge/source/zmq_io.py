"""Non-blocking pyzmq under anyio: drain what is queued, then wait once.

One await per message costs more than the message; draining with NOBLOCK
until EAGAIN and only then waiting on the socket's FD keeps the loop cheap.
"""

from __future__ import annotations

import anyio
import zmq

# ZMQ's FD is edge-triggered: a missed edge must not park the loop forever.
_WAIT_BOUND_S = 0.05


async def wait_readable(sock: zmq.Socket[bytes]) -> None:
    if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
        return
    with anyio.move_on_after(_WAIT_BOUND_S):
        await anyio.wait_readable(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]


def drain(sock: zmq.Socket[bytes], limit: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    recv = sock.recv_multipart
    try:
        while len(out) < limit:
            out.append(recv(zmq.NOBLOCK))
    except zmq.Again:
        pass
    return out


async def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await wait_readable(sock)
