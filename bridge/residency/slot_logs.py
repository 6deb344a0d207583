"""Per (slot, tier): the ids the slot took, and its counts.

What a gap, a clear or a restart of one worker walks instead of the fleet's
columns: 4 bytes per id taken, appended on every store and never edited on a
removal, so it is checked against the tier when read and compacted when it
has grown to twice what the slot holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from bridge.residency.slots import BITS


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

    def iter_live(self, held: array[int], slot: int, sets: list[int], pause: int = 0) -> Iterator[int]:
        """The ids the slot holds in the tier whose held column is `held` (sid
        → bitset in `sets`), one at a time in the order the log took them.
        With `pause`, also -1 after every `pause` entries of the log read,
        held or not, so that a reader can pause at even intervals (nothing
        may change the tier until it is done)."""
        ss = 2 * slot + 1
        b = BITS[slot]
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

    def live(self, held: array[int], slot: int, sets: list[int]) -> list[int]:
        """`iter_live`'s ids at once, the log compacted to them."""
        ids = list(self.iter_live(held, slot, sets))
        if len(self.log) > len(ids) + 16:
            self.log = array("I", ids)
        return ids
