"""Per (slot, tier): the ids the slot took, and its counts.

What a gap, a clear or a restart of one worker walks instead of the fleet's
columns: 4 bytes per id taken, appended on every store and never edited on a
removal, so it is checked against the tier when read and compacted when it
has grown to twice what the slot holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator


class SlotLog:
    """One slot's share of one tier: the ids it took (checked against the
    tier when read) and its counts."""

    __slots__ = ("log", "held", "trusted", "suspect", "placeholders")

    def __init__(self) -> None:
        self.log = array("I")
        self.held = 0  # ids with any copy
        self.trusted = 0  # ... with a trusted copy
        self.suspect = 0  # ... with a suspect copy
        self.placeholders = 0  # placeholder copies

    def took(self, ids: list[int]) -> bool:
        """Log ids the slot just joined; True when the log wants compacting."""
        log = self.log
        log.extend(ids)
        return len(log) > 2 * self.held + 64

    def live(self, held: array[int], slot: int, sets: list[int]) -> list[int]:
        """The ids the slot holds in the tier whose held column is `held` (sid
        → bitset in `sets`): its log, checked and compacted."""
        ss = 2 * slot + 1
        b = 1 << slot
        # The test of `iter_live`, spelled out here: a call per id would cost
        # a compaction of a long log (inside a store) a third more.
        ids = [i for i in set(self.log) if held[i] == ss or (held[i] and not held[i] & 1 and sets[held[i]] & b)]
        if len(self.log) > len(ids) + 16:
            self.log = array("I", ids)
        return ids

    def iter_live(self, held: array[int], slot: int, sets: list[int], pause: int = 0) -> Iterator[int]:
        """`live`'s ids, one at a time in the order the log took them, without
        compacting. With `pause`, also -1 after every `pause` entries of the
        log read, held or not, so that a reader can pause at even intervals
        (nothing may change the tier until it is done)."""
        ss = 2 * slot + 1
        b = 1 << slot
        seen: set[int] = set()
        add = seen.add
        for k, i in enumerate(self.log, 1):
            if pause and not k % pause:
                yield -1
            if i in seen:
                continue
            add(i)
            h = held[i]
            if h == ss or (h and not h & 1 and sets[h] & b):
                yield i
