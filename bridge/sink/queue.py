"""The bounded buffer between ZMQ and NATS.

Policy when full: the oldest batch goes, its (stream, seq) joins a lost range,
and before that stream's next batch a `gap` record names the range. Memory
stays bounded however long NATS is away; every loss is announced.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec

from bridge.sink.encode import Outgoing


class OutBatch(msgspec.Struct, gc=False):
    stream: int  # index of the publisher stream (endpoint × rank)
    epoch: int
    seq: int  # -1 for records not tied to a vLLM batch
    vllm_ts: float
    messages: list[Outgoing]
    dp_rank: int = 0


class LostRange(msgspec.Struct, gc=False):
    stream: int
    epoch: int
    first: int
    last: int


GapMaker = Callable[[LostRange], OutBatch]


def _ignore() -> None:
    return None


class BatchQueue:
    def __init__(self, max_batches: int, make_gap: GapMaker, on_drop: Callable[[], None] = _ignore) -> None:
        self._max = max_batches
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
        if len(self._items) >= self._max:
            self._drop_oldest()
        self._items.append(batch)
        if self._full_since is None and len(self._items) >= self._max:
            self._full_since = time.monotonic()
        self._event.set()

    def _drop_oldest(self) -> None:
        # Records (seq < 0) are small and carry losses or restarts: they stay.
        index = next((i for i, item in enumerate(self._items) if item.seq >= 0), None)
        if index is None:
            return
        old = self._items[index]
        del self._items[index]
        self.dropped += 1
        self._on_drop()
        key = (old.stream, old.epoch)
        lost = self._lost.get(key)
        if lost is None:
            self._lost[key] = LostRange(old.stream, old.epoch, old.seq, old.seq)
        else:
            lost.first = min(lost.first, old.seq)
            lost.last = max(lost.last, old.seq)

    def peek(self) -> OutBatch | None:
        """The next batch to publish. Gap records for dropped ranges come first:
        everything still queued is newer than what was dropped."""
        if self._lost:
            key = next(iter(self._lost))
            gap = self._make_gap(self._lost.pop(key))
            self._items.appendleft(gap)
        return self._items[0] if self._items else None

    def pop(self) -> None:
        self._items.popleft()
        self._full_since = None
        if len(self._items) < self._max:
            self._room.set()

    def progressing(self, within: float) -> bool:
        """False once the queue has stayed full for `within` seconds with no
        batch taken: the sink is stalled, not just behind."""
        return self._full_since is None or time.monotonic() - self._full_since < within

    def full(self) -> bool:
        return len(self._items) >= self._max

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
        self._event.set()

    async def wait(self) -> None:
        while not self._items and not self._lost:
            self._event = anyio.Event()
            await self._event.wait()
