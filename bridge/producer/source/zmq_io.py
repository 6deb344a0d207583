"""Non-blocking pyzmq under anyio: drain what is queued, then wait once.

One await per message costs more than the message; draining with NOBLOCK
until EAGAIN (or a budget) and only then waiting on the socket's FD keeps the
loop cheap.
"""

from __future__ import annotations

import select

import anyio
import zmq

# ZMQ's FD is edge-triggered: a missed edge must not park the loop forever.
# None should be missed (EVENTS is read before every wait, and only its own
# loop touches a socket), so this is a safety net, long enough that an idle
# bridge sleeps: at 50 ms it woke 20 times a second (1.2 % of a CPU), at 1 s
# 2.5 times (0.1 %).
_WAIT_BOUND_S = 1.0


_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def readable(sock: zmq.Socket[bytes]) -> bool:
    """A message is queued (this also re-arms ZMQ's edge-triggered FD)."""
    return bool(sock.get(_EVENTS) & _POLLIN)  # type: ignore[operator]  # EVENTS is an int option


async def wait_readable(sock: zmq.Socket[bytes], bound_s: float = _WAIT_BOUND_S) -> bool:
    """Until a message is queued, or `bound_s` passed; True if one already was
    (then it did not yield to the event loop)."""
    if readable(sock):
        return True
    with anyio.move_on_after(bound_s):
        await anyio.wait_readable(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
    return False


def drain(sock: zmq.Socket[bytes], limit: int, max_bytes: int = 0) -> list[list[bytes]]:
    """Up to `limit` queued messages without blocking; with `max_bytes`, stop
    once their last frames add up to that much."""
    out: list[list[bytes]] = []
    append = out.append
    # A frame says itself whether more follow; asking the socket (get(RCVMORE),
    # as recv_multipart() does) builds an enum per frame.
    recv = sock.recv
    noblock = zmq.NOBLOCK
    size = 0
    try:
        while len(out) < limit:
            frame = recv(noblock, copy=False)
            parts = [frame.bytes]
            while frame.more:
                # The rest of a multipart message is already there: ZMQ delivers it whole.
                frame = recv(noblock, copy=False)
                parts.append(frame.bytes)
            append(parts)
            if max_bytes:
                size += len(parts[-1])
                if size >= max_bytes:
                    break
    except zmq.Again:
        pass
    return out


class InputWatch:
    """Whether a message may be waiting on any watched socket, asked without
    touching the sockets: reading a socket's EVENTS consumes the edge its FD
    signals, so its own reader, waiting on that FD, would not wake. This
    polls the FDs themselves: readable from a message's arrival until that
    reader reads. Work that may wait (the snapshot keeper) asks it between
    pieces."""

    def __init__(self) -> None:
        self._poll = select.poll()

    def add(self, sock: zmq.Socket[bytes]) -> None:
        self._poll.register(sock.get(zmq.FD), select.POLLIN)  # type: ignore[arg-type]

    def remove(self, sock: zmq.Socket[bytes]) -> None:
        try:
            self._poll.unregister(sock.get(zmq.FD))  # type: ignore[arg-type]
        except (KeyError, zmq.ZMQError):
            pass

    def waiting(self) -> bool:
        return bool(self._poll.poll(0))
