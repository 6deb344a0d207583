"""Core mode: which batches the server has surely read.

Core NATS has no acks, but a PING is answered only after everything written
before it was read. The batches handed to the client since the last answered
PING are what a client closed for good may have taken with it: they are the
ones a `gap` record (reason `connection_closed`) names then.
"""

from __future__ import annotations

from collections import deque

import msgspec

from bridge.producer.sink.queue import OutBatch


class WrittenRun(msgspec.Struct, frozen=True):
    """Seqs `first`..`last` of pipeline `stream`'s epoch `epoch`, handed to the client."""

    stream: int
    epoch: int
    first: int
    last: int


class Unconfirmed:
    """Runs of written batches in segments, one per PING asked for (the last
    segment: since the newest PING). An answered PING drops the segments
    written before it. Memory: one run per rank and epoch per segment."""

    def __init__(self) -> None:
        self._segments: deque[dict[tuple[int, int], list[int]]] = deque([{}])
        # Segments dropped from the left so far: marks stay valid across drops.
        self._dropped = 0

    def note(self, batches: list[OutBatch]) -> None:
        runs = self._segments[-1]
        for batch in batches:
            if batch.seq < 0:
                continue  # a record: it names no batch of its own
            run = runs.get((batch.stream, batch.epoch))
            if run is None:
                runs[(batch.stream, batch.epoch)] = [batch.seq, batch.seq]
            else:
                run[0] = min(run[0], batch.seq)
                run[1] = max(run[1], batch.seq)

    def mark(self) -> int:
        """Before a PING: what is written so far gets this mark."""
        self._segments.append({})
        return self._dropped + len(self._segments) - 1

    def confirm(self, mark: int) -> None:
        """The PING sent after `mark` was answered: everything before it arrived."""
        while self._dropped < mark and len(self._segments) > 1:
            self._segments.popleft()
            self._dropped += 1

    def take(self) -> list[WrittenRun]:
        """Every run not confirmed, merged per rank and epoch; forgets them."""
        merged: dict[tuple[int, int], list[int]] = {}
        for segment in self._segments:
            for key, (first, last) in segment.items():
                run = merged.get(key)
                if run is None:
                    merged[key] = [first, last]
                else:
                    run[0], run[1] = min(run[0], first), max(run[1], last)
        self._dropped += len(self._segments)
        self._segments = deque([{}])
        return [WrittenRun(stream, epoch, first, last) for (stream, epoch), (first, last) in merged.items()]
