"""What a stream still holds after a position: the test a late consumer and
a rebuilding bridge apply before trusting that a snapshot (or a reset record)
plus the stream's messages after it make a rank's whole history.

A stream loses messages from its front (`--stream-max-age`,
`--stream-max-bytes`, a message-count limit: its first sequence moves on) and
from its middle (`--stream-max-msgs-per-subject` deletes a subject's oldest
message wherever it sits; an operator may delete any message). The first
sequence alone misses the second kind: a per-subject limit can leave it at 1
(a worker's `start` record) while most messages after it are gone. The
stream's state lists those interior deletions (`deleted`), but not the subject
each was on, so any deletion after a position counts against every rank read
from there: a view may be flagged partial that lost nothing, never the other
way round.
"""

from __future__ import annotations

from bisect import bisect_right

import msgspec


class StreamHoldings(msgspec.Struct, frozen=True):
    """A stream's state as read at one moment: `first_seq`, `last_seq`,
    `deleted` (interior deletions, ascending) and `deletions_unknown` (the
    stream said it has some but they could not be listed)."""

    first_seq: int
    last_seq: int
    deleted: tuple[int, ...] = ()
    deletions_unknown: bool = False

    def holds_after(self, seq: int) -> bool:
        """Whether every message the stream stored after stream sequence
        `seq` (up to `last_seq`) is still in it."""
        if self.first_seq > seq + 1:
            return False  # dropped from the front: age, bytes, count
        if seq >= self.last_seq:
            return True
        if self.deletions_unknown:
            return False
        return not self.deleted or self.deleted[-1] <= seq

    def missing_after(self, seq: int) -> str:
        """Why `holds_after(seq)` is False, for a SnapshotMissing's reason and logs."""
        if self.first_seq > seq + 1:
            return f"the stream no longer holds what followed stream sequence {seq} (it now starts at {self.first_seq})"
        if self.deletions_unknown:
            return f"the stream deleted messages it could not list; some may follow stream sequence {seq}"
        after = len(self.deleted) - bisect_right(self.deleted, seq)
        return f"the stream deleted {after} message(s) after stream sequence {seq} (a per-subject limit or a delete)"


def holdings_from_state(state: dict[str, object]) -> StreamHoldings:
    """From a JetStream `STREAM.INFO` answer's `state` (asked with
    `deleted_details`); a count of deletions with no list of them leaves
    them unknown."""
    first = int(state.get("first_seq", 0) or 0)  # type: ignore[call-overload]
    last = int(state.get("last_seq", 0) or 0)  # type: ignore[call-overload]
    listed = state.get("deleted") or []
    count = int(state.get("num_deleted", 0) or 0)  # type: ignore[call-overload]
    deleted = tuple(sorted(int(d) for d in listed)) if isinstance(listed, list) else ()
    return StreamHoldings(first, last, deleted, deletions_unknown=count > len(deleted))
