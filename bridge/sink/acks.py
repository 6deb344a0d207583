"""JetStream publishes awaiting their PubAck, by the reply token each went out with.

The bridge writes JetStream publishes as raw HPUB frames, a whole queue's worth
per socket write, each with the reply subject `<inbox>.<token>`; the server's
PubAck comes back on that subject and is matched here by token. No future,
task or JSON parse per message: that bookkeeping in nats-py's publish_async
cost more than everything else the bridge does per message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

from bridge.sink.encode import Outgoing
from bridge.sink.queue import OutBatch

# A message and the batch it came from (None: not tied to one), which a
# publisher that gives up on the message names in a gap record.
Sent = tuple[Outgoing, OutBatch | None]

# A PubAck is `{"stream":...,"seq":...}` (maybe `"duplicate":true`); a refusal
# is `{"error":{...}}`. Nothing else has to be read to tell them apart.
_ERROR_KEY = b'"error"'


def ack_error(data: bytes, headers: bytes | None) -> str | None:
    """None for a PubAck; else why the server did not store the message."""
    if headers and headers[8:9] == b" ":
        # An inline status (`NATS/1.0 503\r\n\r\n`): no stream took the subject.
        return f"status {bytes(headers[9:12]).decode(errors='replace')}"
    if _ERROR_KEY in data[:16]:
        return bytes(data[:200]).decode(errors="replace")
    if not data.startswith(b"{"):
        return "not a PubAck"
    return None


def take_acks(data: bytes, prefix: bytes, on_ack: Callable[[bytes, bytes, bytes | None], None]) -> int:
    """Hands the whole `MSG <inbox>.<token> <sid> <size>` frames at the start
    of `data` (`prefix` is `MSG <inbox>.`) to `on_ack`; returns the bytes they
    took. Stops at anything else and at a frame the read cut off: nats-py's
    parser takes the rest. A PubAck has neither reply subject nor headers."""
    pos = 0
    end = len(data)
    find = data.find
    while data.startswith(prefix, pos):
        eol = find(b"\r\n", pos)
        if eol < 0:
            break
        parts = data[pos + 4 : eol].split(b" ")
        if len(parts) != 3 or not parts[2].isdigit():
            break
        start = eol + 2
        stop = start + int(parts[2])
        if stop + 2 > end:
            break
        on_ack(parts[0], data[start:stop], None)
        pos = stop + 2
    return pos


class _Pending:
    __slots__ = ("generation", "msg", "origin", "sent")

    def __init__(self, msg: Outgoing, origin: OutBatch | None, generation: int, sent: float) -> None:
        self.msg = msg
        self.origin = origin
        self.generation = generation
        self.sent = sent


class AckWindow:
    """In send order: what was published and not yet acked. A refused message
    waits in `failed` for the publisher to send again (same Nats-Msg-Id, which
    the stream de-duplicates)."""

    def __init__(self, inbox: str = "") -> None:
        self.inbox = inbox
        self._prefix_len = len(inbox) + 1
        # Insertion order is send order: the first entry is the oldest.
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        # Refused by the server: (message, its batch, why), oldest first.
        self.failed: deque[tuple[Outgoing, OutBatch | None, str]] = deque()
        self._low_water = 0
        self._low_bytes = 0
        self._room: anyio.Event | None = None
        # Encoded bytes in flight (payloads and headers): the window's memory.
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._pending)

    def reply_to(self, msg: Outgoing, generation: int, now: float, origin: OutBatch | None = None) -> str:
        """Registers `msg` (of batch `origin`) as sent; the reply subject its ack will come back on."""
        token = self._next
        self._next = token + 1
        self._pending[token] = _Pending(msg, origin, generation, now)
        self.bytes += msg.nbytes
        return f"{self.inbox}.{token}"

    def forget_since(self, reply: str) -> None:
        """A write that never reached the connection: its messages are not in flight."""
        first = int(reply[self._prefix_len:])
        for token in [t for t in self._pending if t >= first]:
            self._settle(self._pending.pop(token).msg)

    def _settle(self, msg: Outgoing) -> None:
        self.bytes -= msg.nbytes

    def on_ack(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        """From the connection's parser, for every message on `<inbox>.*`."""
        try:
            token = int(subject[self._prefix_len:])
        except ValueError:
            return
        entry = self._pending.pop(token, None)
        if entry is None:
            return  # settled already: sent again after a timeout or a reconnect
        msg = entry.msg
        self._settle(msg)
        error = ack_error(data, headers)
        if error is not None:
            self.failed.append((msg, entry.origin, error))
        if self._room is not None and (
            (len(self._pending) <= self._low_water and self.bytes <= self._low_bytes) or self.failed
        ):
            self._room.set()

    def overdue(self, now: float, timeout: float, generation: int) -> list[Sent]:
        """Takes out, oldest first, what will not be acked: sent on an earlier
        connection, or waiting longer than `timeout`."""
        out: list[Sent] = []
        pending = self._pending
        while pending:
            token = next(iter(pending))
            entry = pending[token]
            if entry.generation == generation and now - entry.sent < timeout:
                break
            del pending[token]
            self._settle(entry.msg)
            out.append((entry.msg, entry.origin))
        return out

    def first_generation(self) -> int:
        """The connection generation the oldest message in flight was sent on."""
        return next(iter(self._pending.values())).generation if self._pending else -1

    def oldest_age(self, now: float) -> float:
        if not self._pending:
            return 0.0
        return now - next(iter(self._pending.values())).sent

    async def wait_below(self, low_water: int, timeout: float, low_bytes: int = 1 << 62) -> None:
        """Until at most `low_water` messages and `low_bytes` bytes are in
        flight, a refusal came, or `timeout`."""
        if (len(self._pending) <= low_water and self.bytes <= low_bytes) or self.failed:
            return
        self._low_water = low_water
        self._low_bytes = low_bytes
        self._room = anyio.Event()
        try:
            with anyio.move_on_after(timeout):
                await self._room.wait()
        finally:
            self._room = None
