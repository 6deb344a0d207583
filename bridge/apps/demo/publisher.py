"""A stand-in for vLLM's ZmqEventPublisher: PUB with seq frames and a replay
ROUTER with the same protocol and end marker. For the demo, the benchmark and
tests that must run without vLLM; tests that can use vLLM's own publisher do."""

from __future__ import annotations

import threading
import time
from collections import deque
from queue import Empty, Queue

import zmq

from bridge.producer.source.frames import END_SEQ_FRAME


class WirePublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "", buffer_steps: int = 10_000,
                 hwm: int = 100_000, first_seq: int = 0) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            # A port taken: what was opened goes now. Left to the garbage
            # collector, the context's finalizer waits for the open socket
            # and holds whatever thread collects it.
            self._ctx.destroy(linger=0)
            raise
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # (payload, drop) for a batch; a list of frames for raw bytes on the PUB socket.
        self._queue: Queue[tuple[bytes, bool] | list[bytes] | None] = Queue()
        self._seq = first_seq
        self._thread = threading.Thread(target=self._loop, name="wire-publisher", daemon=True)
        self._running = True
        self._thread.start()

    def publish(self, payload: bytes, *, drop: bool = False) -> None:
        """Queue one batch. `drop=True` numbers and buffers it for replay but
        never sends it live: a batch lost on the way, as a slow subscriber sees."""
        self._queue.put((payload, drop))

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    @property
    def next_seq(self) -> int:
        return self._seq

    def _loop(self) -> None:
        while self._running:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.01)
            except Empty:
                continue
            if item is None:
                break
            try:
                if isinstance(item, list):
                    self._pub.send_multipart(item)
                    continue
                payload, drop = item
                seq = self._seq
                seq_bytes = seq.to_bytes(8, "big")
                if not drop:
                    self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                self._seq += 1
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ_FRAME, b""))

    def send_raw(self, parts: list[bytes]) -> None:
        """Arbitrary frames on the PUB socket, in order with the batches: for
        tests that mix hostile frames into good traffic."""
        self._queue.put(list(parts))

    def close(self) -> None:
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
