"""Traffic shaped like a hybrid model's vLLM worker: a full-attention group, a
sliding-window group and a mamba (recurrent state) group, as vLLM 0.33.0 emits
them. Deterministic for a seed, so tests, benchmarks and the demo can count on it.

With `engine_shapes=True` (the demo and the benchmark) it also sends what a real
engine's GPU tier sends and a tidy generator would not: window stores that
list only the blocks inside the window while their token ids cover every new
block (null blocks are skipped in the hashes, not in the tokens), mamba
stores with all the request's token ids, and mamba stores with no hash at all
(no block of the step holds state), and `extra_keys` lists of None."""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from bridge.apps.demo.wire_writer import cleared, encode_batch, removed, stored
from bridge.contract import Event

ATTN, WINDOW, MAMBA = 0, 1, 2
BLOCK_SIZE = 16
WINDOW_TOKENS = 128


class HybridWorkload:
    """Each request stores a chain of blocks in every group; later evictions remove them."""

    def __init__(self, seed: int = 0, int_hashes: bool = False, dp_rank: int | None = None,
                 engine_shapes: bool = False) -> None:
        self._rng = random.Random(seed)
        self._engine_shapes = engine_shapes
        self._int_hashes = int_hashes
        self._dp_rank = dp_rank
        self._resident: list[list[Any]] = []
        self._counter = 0

    def _hash(self, parent: Any, tokens: list[int]) -> Any:
        digest = hashlib.sha256(repr((parent, tokens, self._counter)).encode()).digest()
        self._counter += 1
        return int.from_bytes(digest[-8:], "big") if self._int_hashes else digest

    def request_events(self, blocks: int) -> list[Event]:
        """One request's stores: attention gets every hash, the window group its
        recent blocks, the mamba group a checkpoint at the last hash."""
        hashes: list[Any] = []
        tokens: list[int] = []
        parent: Any = None
        for _ in range(blocks):
            block_tokens = [self._rng.randrange(32000) for _ in range(BLOCK_SIZE)]
            h = self._hash(parent, block_tokens)
            hashes.append(h)
            tokens.extend(block_tokens)
            parent = h
        self._resident.append(hashes)
        recent = max(1, WINDOW_TOKENS // BLOCK_SIZE)
        if self._engine_shapes:
            return self._engine_request(hashes, tokens, recent)
        return [
            stored(hashes, None, tokens, BLOCK_SIZE, group_idx=ATTN, kind="full_attention"),
            stored(hashes[-recent:], hashes[-recent - 1] if len(hashes) > recent else None,
                   tokens[-recent * BLOCK_SIZE:], BLOCK_SIZE, group_idx=WINDOW, kind="sliding_window",
                   sliding_window=WINDOW_TOKENS),
            stored([hashes[-1]], hashes[-2] if len(hashes) > 1 else None, [], BLOCK_SIZE,
                   group_idx=MAMBA, kind="mamba"),
        ]

    def _engine_request(self, hashes: list[Any], tokens: list[int], recent: int) -> list[Event]:
        attention = stored(hashes, None, tokens, BLOCK_SIZE, group_idx=ATTN, kind="full_attention")
        attention.extra_keys = [None] * len(hashes)
        events: list[Event] = [
            attention,
            # the parent is the hash before the first new block, not before the first listed
            stored(hashes[-recent:], None, tokens, BLOCK_SIZE, group_idx=WINDOW, kind="sliding_window",
                   sliding_window=WINDOW_TOKENS),
        ]
        if self._rng.random() < 0.3:
            # no block of this step holds a state checkpoint
            events.append(stored([], None, tokens, BLOCK_SIZE, group_idx=MAMBA, kind="mamba"))
        else:
            events.append(stored([hashes[-1]], None, tokens, BLOCK_SIZE, group_idx=MAMBA, kind="mamba"))
        return events

    def eviction_events(self) -> list[Event]:
        if not self._resident:
            return []
        hashes = self._resident.pop(0)
        return [
            removed(hashes, group_idx=ATTN),
            removed([hashes[-1]], group_idx=MAMBA),
        ]

    def offload_events(self) -> list[Event]:
        """The CPU tier: attention chunks in full, window and mamba as vLLM's placeholders."""
        if not self._resident:
            return []
        hashes = self._resident[-1]
        return [
            stored(hashes[-4:], hashes[-5] if len(hashes) > 4 else None, [], BLOCK_SIZE, medium="CPU",
                   group_idx=ATTN, kind="full_attention"),
            stored([hashes[-1]], None, [], 0, medium="CPU", group_idx=WINDOW, kind="sliding_window",
                   sliding_window=WINDOW_TOKENS),
            stored([hashes[-1]], None, [], 0, medium="CPU", group_idx=MAMBA, kind="mamba"),
        ]

    def batch(self, events_target: int, clear: bool = False) -> bytes:
        """A batch of about `events_target` events: whole requests, evictions
        and offloads, so every group shows up."""
        events: list[Event] = []
        while len(events) < events_target:
            roll = self._rng.random()
            if roll < 0.6 or not self._resident:
                events.extend(self.request_events(self._rng.randint(2, 8)))
            elif roll < 0.85:
                events.extend(self.eviction_events())
            else:
                events.extend(self.offload_events())
        events = events[:events_target]
        if clear:
            events.append(cleared())
            self._resident.clear()
        return encode_batch(time.time(), events, self._dp_rank)
