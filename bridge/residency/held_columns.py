"""One rank's tier as a snapshot lists it: hashes and their copies, per layer.

Both stores hand a tier over in this form (`SlotStore.held_columns`), a
generator that pauses now and then so that a reader on an event loop (the
bridge exporting a snapshot) takes a large tier between its other work. The
fleet structure reads its log entry by entry (`from_copies`); the per-rank
tables copy their dicts a slice at a time, which costs a few nanoseconds an
entry, not the few hundred a Python loop does.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import NamedTuple

from bridge.contract import BlockHash

# Entries read between two pauses, entry by entry: a few hundred microseconds.
ENTRY_STEP = 256


class HeldColumns(NamedTuple):
    """A tier's hashes per layer, each with its copies; a layer's copies are
    an empty list when every one of them is one (the snapshot's form)."""

    trusted: list[BlockHash]
    trusted_copies: list[int]
    suspect: list[BlockHash]
    suspect_copies: list[int]
    placeholders: list[BlockHash]
    placeholder_copies: list[int]


def ones_left_out(copies: list[int]) -> list[int]:
    """`copies`, or an empty list when every count is one."""
    return copies if copies.count(1) != len(copies) else []


def from_copies(held: Iterator[tuple[BlockHash, int, int] | None],
                placeholders: Iterator[tuple[BlockHash, int]]) -> Generator[None, None, HeldColumns]:
    """The columns of a tier read entry by entry: `held` gives (hash, trusted
    copies, suspect copies), None where the reader may pause; `placeholders`
    (hash, copies). Pauses every `ENTRY_STEP` placeholders as well."""
    trusted: list[BlockHash] = []
    trusted_n: list[int] = []
    suspect: list[BlockHash] = []
    suspect_n: list[int] = []
    for item in held:
        if item is None:
            yield
            continue
        h, t, u = item
        if t:
            trusted.append(h)
            trusted_n.append(t)
        if u:
            suspect.append(h)
            suspect_n.append(u)
    yield
    marks: list[BlockHash] = []
    marks_n: list[int] = []
    for h, n in placeholders:
        marks.append(h)
        marks_n.append(n)
        if not len(marks) % ENTRY_STEP:
            yield
    return HeldColumns(trusted, ones_left_out(trusted_n), suspect, ones_left_out(suspect_n),
                       marks, ones_left_out(marks_n))
