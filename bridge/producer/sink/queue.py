"""The bounded buffer between ZMQ and NATS.

Policy when full (too many batches, or too many bytes): the oldest batch goes,
its (stream, seq) joins a lost range, and before that stream's next batch a
`gap` record names the range. Memory stays bounded however long NATS is away
and however large vLLM's batches are; every loss is announced.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec

from bridge.producer.sink.encode import Outgoing


class OutBatch(msgspec.Struct, gc=False):
    stream: int  # index of the publisher stream (endpoint × rank)
    epoch: int
    seq: int  # -1 for records not tied to a vLLM batch
    vllm_ts: float
    messages: list[Outgoing]
    dp_rank: int = 0
    # Encoded bytes held (payloads and headers); counted by the queue on put.
    nbytes: int = -1


class LostRange(msgspec.Struct, gc=False):
    stream: int
    epoch: int
    first: int
    last: int


GapMaker = Callable[[LostRange], OutBatch]


def _ignore() -> None:
    return None


def _size(batch: OutBatch) -> int:
    if batch.nbytes < 0:
        n = 0
        for msg in batch.messages:
            n += msg.nbytes
        batch.nbytes = n
    return batch.nbytes


class BatchQueue:
    """`on_put` sees every batch as it is queued, in order (the group catalog
    learns from them); `on_drop` counts each batch dropped."""

    def __init__(
        self,
        max_batches: int,
        make_gap: GapMaker,
        on_drop: Callable[[], None] = _ignore,
        max_bytes: int = 0,
        on_put: Callable[[OutBatch], None] | None = None,
    ) -> None:
        self._max = max_batches
        self._on_put = on_put
        # 0: no byte bound.
        self._max_bytes = max_bytes or (1 << 62)
        self.bytes = 0
        self._on_drop = on_drop
        self._items: deque[OutBatch] = deque()
        self._lost: dict[tuple[int, int], LostRange] = {}
        self._make_gap = make_gap
        self._event = anyio.Event()
        self._room = anyio.Event()
        # When the queue last became full with no batch taken since.
        self._full_since: float | None = None
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items) + len(self._lost)

    def put(self, batch: OutBatch) -> None:
        """Never blocks: the ZMQ side must keep reading or vLLM's PUB drops silently."""
        if self._on_put is not None:
            self._on_put(batch)
        if len(self._items) >= self._max:
            self._drop_oldest()
        # Full by bytes: make room first, so the bound holds to within this one
        # batch, and a queue the pipeline keeps below it (backpressure) loses nothing.
        while self.bytes >= self._max_bytes and self._drop_oldest():
            pass
        self._items.append(batch)
        self.bytes += _size(batch)
        if self._full_since is None and self.full():
            self._full_since = time.monotonic()
        self._event.set()

    def _drop_oldest(self) -> bool:
        # Records (seq < 0) are small and carry losses or restarts: they stay.
        index = next((i for i, item in enumerate(self._items) if item.seq >= 0), None)
        if index is None:
            return False
        old = self._items[index]
        del self._items[index]
        self.bytes -= _size(old)
        self.dropped += 1
        self._on_drop()
        key = (old.stream, old.epoch)
        lost = self._lost.get(key)
        if lost is None:
            self._lost[key] = LostRange(old.stream, old.epoch, old.seq, old.seq)
        else:
            lost.first = min(lost.first, old.seq)
            lost.last = max(lost.last, old.seq)
        return True

    def peek(self) -> OutBatch | None:
        """The next batch to publish. Gap records for dropped ranges come first:
        everything still queued is newer than what was dropped."""
        if self._lost:
            key = next(iter(self._lost))
            gap = self._make_gap(self._lost.pop(key))
            self._items.appendleft(gap)
            self.bytes += _size(gap)
        return self._items[0] if self._items else None

    def pop(self) -> None:
        self.bytes -= _size(self._items.popleft())
        self._full_since = None
        if not self.full():
            self._room.set()

    def progressing(self, within: float) -> bool:
        """False once the queue has stayed full for `within` seconds with no
        batch taken: the sink is stalled, not just behind."""
        return self._full_since is None or time.monotonic() - self._full_since < within

    def full(self) -> bool:
        return len(self._items) >= self._max or self.bytes >= self._max_bytes

    async def hold(self, sink_up: Callable[[], bool], stalled_after: float) -> None:
        """While full, wait for the sink, as long as it is up and taking
        batches: a full queue then means a burst, not an outage, and ZMQ
        buffers meanwhile (replay heals what its high-water mark drops). While
        the sink is away or stalled (no batch taken for `stalled_after` s: a
        frozen server keeps its TCP connection) the drop-oldest policy bounds
        memory instead."""
        while self.full() and sink_up() and self.progressing(stalled_after):
            await self.wait_for_room(0.1)

    async def wait_for_room(self, timeout: float) -> None:
        """Until the sink takes a batch (or `timeout` passes)."""
        if not self.full():
            return
        self._room = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._room.wait()

    def requeue(self, batches: list[OutBatch]) -> None:
        """Batches taken for a write that failed go back to the front, in order."""
        self._items.extendleft(reversed(batches))
        for batch in batches:
            self.bytes += _size(batch)
        self._event.set()

    async def wait(self) -> None:
        while not self._items and not self._lost:
            self._event = anyio.Event()
            await self._event.wait()
