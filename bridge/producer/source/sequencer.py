"""Per-publisher seq bookkeeping: in order, duplicate, gap or restart.

vLLM's seq starts at 0 per publisher process and rises by one per batch. The
live PUB stream of one process never goes back, so a live seq at or below the
previous live seq means a new process; a live seq at or below what replay
already delivered is the live stream catching up, a duplicate.
"""

from __future__ import annotations

import enum


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


class SeqTracker:
    """`last_emitted=-1` (a fresh bridge) wants the publisher's history from
    seq 0: replay fills it in as far as vLLM still buffers it."""

    def __init__(self, last_emitted: int = -1) -> None:
        self.last_emitted = last_emitted
        self._last_live: int | None = None

    def classify_live(self, seq: int) -> Verdict:
        last_live, self._last_live = self._last_live, seq
        if last_live is not None and seq <= last_live:
            return Verdict.RESTART
        if seq == self.last_emitted + 1:
            return Verdict.ACCEPT
        if seq <= self.last_emitted:
            return Verdict.DUPLICATE
        return Verdict.GAP

    def wants(self, seq: int) -> bool:
        """Whether a replayed batch is new."""
        return seq > self.last_emitted

    def emitted(self, seq: int) -> None:
        self.last_emitted = seq

    def restart(self) -> None:
        """A new publisher process: everything from its seq 0 is wanted."""
        self.last_emitted = -1

    def next_wanted(self) -> int:
        return self.last_emitted + 1
