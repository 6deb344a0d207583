"""The counting subscriber: the NATS end of the benchmark.

It speaks the NATS client protocol directly over an asyncio socket (CONNECT,
SUB, MSG/HMSG, PING/PONG) and decodes only what it counts: a group message's
`seq`, `ts` and its events as raw msgpack (counted, not parsed), a naive
message's `ts`. The instrument must cost far less than what it measures on a
2-core machine; nats-py's general-purpose client costs several times more per
message.

Arrival is the kernel's receive timestamp of the data that completed a
message (`SO_TIMESTAMPNS`, Linux): delivery by NATS, not the moment this
Python process got scheduled to look at it (which on a busy 2-core machine
can be milliseconds later and would be the instrument's delay, not the
bridge's). It is the newest segment of each read, so never earlier than the
true arrival. Elsewhere it falls back to the clock at read time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
import time

import msgspec

from bench.stats import LatencyLog
from bridge.contract import WorkerRecord


class _GroupLight(msgspec.Struct):
    seq: int
    ts: float
    events: list[msgspec.Raw]


class _NaiveLight(msgspec.Struct):
    ts: float
    seq: int


# Linux: SO_TIMESTAMPNS == SCM_TIMESTAMPNS; the value is a struct timespec.
_SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
_READ_BYTES = 1 << 20


class Counter(asyncio.Protocol):
    """Counts events arriving on `subject`. `naive=True`: one JSON event per message."""

    def __init__(self, naive: bool = False) -> None:
        self._naive = naive
        self._group = msgspec.msgpack.Decoder(_GroupLight).decode
        self._naive_decode = msgspec.json.Decoder(_NaiveLight).decode
        self._record = msgspec.msgpack.Decoder(WorkerRecord).decode
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None
        self._arrival: float | None = None  # kernel receive time of the data being parsed
        self._pong = asyncio.Event()
        self.errors: list[str] = []
        self.records: dict[str, int] = {}
        self.gaps: list[tuple[int, int]] = []
        self.reset(0)

    # -- control ---------------------------------------------------------

    def reset(self, expect: int, latency: bool = False, track_seqs: bool = False) -> None:
        self.expect = expect
        self.events = 0
        self.messages = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.latency = LatencyLog() if latency else None
        self.seqs: set[int] | None = set() if track_seqs else None
        self.gaps_at_reset = len(self.gaps)
        self.done = asyncio.Event()
        if expect <= 0:
            self.done.set()

    async def connect(self, host: str, port: int, subject: str) -> None:
        loop = asyncio.get_running_loop()
        if sys.platform == "linux":
            await self._connect_timestamped(loop, host, port)
        else:
            await loop.create_connection(lambda: self, host, port)
        assert self._transport is not None
        connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": False,
                   "protocol": 1, "name": "kvb-bench-counter", "lang": "python-raw", "version": "0"}
        self._transport.write(f"CONNECT {json.dumps(connect)}\r\nSUB {subject} 1\r\nPING\r\n".encode())
        await asyncio.wait_for(self._pong.wait(), 10)

    async def wait(self, stall_s: float) -> bool:
        """Until `expect` events came; False once nothing arrived for `stall_s`."""
        seen = -1
        while not self.done.is_set():
            if self.events == seen:
                return False
            seen = self.events
            try:
                await asyncio.wait_for(self.done.wait(), stall_s)
            except TimeoutError:
                continue
        return True

    def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        elif self._transport is not None:
            self._transport.close()

    async def _connect_timestamped(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        self._sock = sock
        self._transport = _SocketWriter(sock)  # type: ignore[assignment]
        loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data, anc, _flags, _addr = self._sock.recvmsg(_READ_BYTES, socket.CMSG_SPACE(_TIMESPEC.size))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.connection_lost(exc)
            self.close()
            return
        if not data:
            self.connection_lost(None)
            self.close()
            return
        self._arrival = None
        for level, kind, value in anc:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(value) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(value)
                self._arrival = sec + nsec * 1e-9
        self.data_received(data)

    # -- protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.errors.append(f"connection lost: {exc!r}")

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        size = len(buf)
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            op = buf[pos : pos + 4]
            if op == b"MSG " or op == b"HMSG":
                parts = bytes(buf[pos:eol]).split()
                total = int(parts[-1])
                start = eol + 2
                end = start + total
                if end + 2 > size:
                    break
                hdr_len = int(parts[-2]) if op == b"HMSG" else 0
                view = memoryview(buf)
                try:
                    self._on_msg(parts[1], view[start : start + hdr_len], view[start + hdr_len : end])
                finally:
                    view.release()
                pos = end + 2
            else:
                line = bytes(buf[pos:eol])
                pos = eol + 2
                if line == b"PING":
                    assert self._transport is not None
                    self._transport.write(b"PONG\r\n")
                elif line == b"PONG":
                    self._pong.set()
                elif line.startswith(b"-ERR"):
                    self.errors.append(line.decode(errors="replace"))
        if pos:
            del buf[:pos]

    def _on_msg(self, subject: bytes, headers: memoryview, payload: memoryview) -> None:
        now = self._arrival or time.time()
        if subject.endswith(b".worker"):
            rec = self._record(payload)
            self.records[rec.type] = self.records.get(rec.type, 0) + 1
            if rec.type == "gap" and rec.gap_from is not None and rec.gap_to is not None:
                self.gaps.append((rec.gap_from, rec.gap_to))
            return
        light: _GroupLight | _NaiveLight
        if self._naive:
            light = self._naive_decode(payload)
            n = 1
        else:
            light = self._group(payload)
            n = len(light.events)
        if self.seqs is not None:
            self.seqs.add(light.seq)
        if not self.messages:
            self.t_first = now
        self.messages += 1
        self.events += n
        self.t_last = now
        if self.latency is not None:
            self.latency.add(now - light.ts, n)
        if self.events >= self.expect:
            self.done.set()


class _SocketWriter:
    """The little the counter writes (CONNECT, SUB, PING, PONG) on its own socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> None:
        self._sock.setblocking(True)
        try:
            self._sock.sendall(data)
        finally:
            self._sock.setblocking(False)

    def close(self) -> None:
        self._sock.close()
