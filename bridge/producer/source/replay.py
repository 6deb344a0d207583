"""Client of vLLM's replay ROUTER: ask from a seq, collect until the end marker."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec
import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from bridge.producer.source.frames import END_SEQ, Frame, FrameError, parse_replay, socket_limit
from bridge.producer.source.zmq_io import wait_readable

log = structlog.get_logger("bridge.replay")

# vLLM buffers 10,000 batches; one answer may hold that many, but at most this
# many frames' worth of bytes (--max-frame-bytes each), 128 MiB by default.
REPLAY_BUDGET_FRAMES = 16
REPLAY_RCVHWM = 1000
# What one held frame costs beyond its payload: an answer of many empty
# frames is bounded too.
FRAME_OVERHEAD = 128
# How often a waiting request looks at its socket's monitor: a cut-off answer
# ends the attempt at once instead of at the timeout.
CUT_OFF_POLL_S = 0.05


class ReplayResult(msgspec.Struct, gc=False):
    frames: list[Frame]
    # The end marker came: the publisher sent all it still buffers.
    complete: bool
    rejected: int
    # The connection dropped before the end marker: libzmq cut off a message
    # past ZMQ_MAXMSGSIZE, or the publisher went away.
    cut_off: bool = False
    # A connection to the replay socket was made at all (nobody listening:
    # asking again at once is no use).
    connected: bool = True


class ReplayClient:
    """One DEALER per request: a reply that arrives after a timeout can never be
    mistaken for the answer to the next request."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        timeout_s: float,
        max_frame_bytes: int,
        on_bad_frame: Callable[[FrameError], None],
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._max_frame_bytes = max_frame_bytes
        # One answer is held whole before its batches are emitted: bounded.
        self._max_bytes = REPLAY_BUDGET_FRAMES * max_frame_bytes
        self._on_bad_frame = on_bad_frame

    @property
    def endpoint(self) -> str:
        return self._endpoint

    async def fetch(self, start_seq: int, stop_after: int | None = None,
                    timeout_s: float | None = None) -> ReplayResult:
        """Batches with seq >= start_seq. `stop_after` lets the caller give up
        reading once it has what it needs; the socket is closed either way.
        `timeout_s`: this attempt's limit, --replay-timeout by default."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Bounded: what does not fit waits in the publisher's send queue.
        sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, socket_limit(self._max_frame_bytes))
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        link = _Link(monitor)
        frames: list[Frame] = []
        held = 0
        rejected = 0
        complete = False
        try:
            sock.connect(self._endpoint)
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            with anyio.move_on_after(self._timeout_s if timeout_s is None else timeout_s):
                while True:
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        # Only once nothing is queued: what arrived before the
                        # cut is read first.
                        if link.cut_off():
                            break
                        await wait_readable(sock, CUT_OFF_POLL_S)
                        continue
                    try:
                        frame = parse_replay(parts, self._max_frame_bytes)
                    except FrameError as exc:
                        rejected += 1
                        self._on_bad_frame(exc)
                        continue
                    if frame.seq == END_SEQ:
                        complete = True
                        break
                    frames.append(frame)
                    if stop_after is not None and frame.seq >= stop_after:
                        complete = True
                        break
                    held += len(frame.payload) + FRAME_OVERHEAD
                    if held > self._max_bytes:
                        # What is not read now is asked for again, or named by a gap.
                        log.warning("replay_budget", endpoint=self._endpoint, start_seq=start_seq, got=len(frames),
                                    max_bytes=self._max_bytes)
                        break
            link.cut_off()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        connected = link.connected or bool(frames) or rejected > 0 or complete
        if link.disconnected and not complete:
            log.warning("replay_cut_off", endpoint=self._endpoint, start_seq=start_seq, got=len(frames))
        elif not complete:
            log.warning("replay_timeout", endpoint=self._endpoint, start_seq=start_seq, got=len(frames),
                        connected=connected)
        return ReplayResult(frames, complete, rejected, link.disconnected and not complete, connected)


class _Link:
    """What a request's socket monitor said: connected, then cut off?"""

    def __init__(self, monitor: zmq.Socket[bytes]) -> None:
        self._monitor = monitor
        self.connected = False
        self.disconnected = False

    def cut_off(self) -> bool:
        """Reads the events so far; whether the connection dropped."""
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return self.disconnected
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.disconnected = True
